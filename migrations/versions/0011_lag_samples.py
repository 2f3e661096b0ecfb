"""Lag samples: each group's lag and stored position over time, for the web console's charts.

One row per group per sample (``kstore console`` takes them every ``console_sample_interval_s``):
the messages behind, the oldest waiting message's age, the sum of the stored offsets (its change
over time is the throughput) and the dead letters waiting. Rows older than
``console_sample_retention_s`` are deleted as new ones are written, so the table stays bounded.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}lag_samples",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("lag_messages", sa.BigInteger, nullable=False),
        sa.Column("lag_seconds", sa.Float, nullable=True),
        sa.Column("stored_offsets", sa.BigInteger, nullable=False),
        sa.Column("dead_letters", sa.BigInteger, nullable=False),
        schema=schema,
    )
    # The retention's DELETE reads by time across groups.
    op.create_index(f"{table_prefix}lag_samples_at", f"{table_prefix}lag_samples", ["at"], schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_index(f"{table_prefix}lag_samples_at", f"{table_prefix}lag_samples", schema=schema)
    op.drop_table(f"{table_prefix}lag_samples", schema=schema)
