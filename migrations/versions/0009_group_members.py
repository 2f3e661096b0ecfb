"""The workers of each group that write to this database: one row per live worker.

A worker registers here before it joins its Kafka group and compares the group's live members
(Kafka's describe group) with these rows: a member this database does not know writes to another
database (one pipeline, one database). ``member`` is the worker's name (its Kafka client id unless
``client_id`` is set), ``kafka_member_id`` its member id in the group (after each join),
``claimed_at`` set once it has claimed a partition of the group. A row not seen for long is ignored
(a worker that died); a clean stop deletes it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}group_members",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("member", sa.String(255), primary_key=True),
        sa.Column("kafka_member_id", sa.String(255), nullable=True),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        schema=schema,
    )


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_table(f"{table_prefix}group_members", schema=schema)
