"""Offsets table and reset history.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}offsets",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("topic", sa.String(255), primary_key=True),
        sa.Column("partition_id", sa.Integer, primary_key=True),
        sa.Column("next_offset", sa.BigInteger, nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("metadata", sa.Text, nullable=True),
        schema=schema,
    )
    op.create_table(
        f"{table_prefix}offset_history",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("consumer_group", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition_id", sa.Integer, nullable=False),
        sa.Column("from_offset", sa.BigInteger, nullable=True),
        sa.Column("to_offset", sa.BigInteger, nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("by_user", sa.String(255), nullable=False),
        sa.Column("by_host", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        schema=schema,
    )
    op.create_index(
        f"{table_prefix}offset_history_group_idx",
        f"{table_prefix}offset_history",
        ["consumer_group", "topic", "partition_id", "at"],
        schema=schema,
    )


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_table(f"{table_prefix}offset_history", schema=schema)
    op.drop_table(f"{table_prefix}offsets", schema=schema)
