"""Lag samples per partition, for the web console's chart of one partition.

One row per partition of each sampled group per sample: the messages behind and the stored next
offset (its change over time is the partition's throughput). The console writes them with the
group's samples and keeps them for an hour (``kstore.console.sampling.PARTITION_RETENTION``), so
the table stays bounded: a group of 600 partitions sampled every 15 s keeps 144,000 rows.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}lag_partition_samples",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("topic", sa.String(255), primary_key=True),
        sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("lag_messages", sa.BigInteger, nullable=False),
        sa.Column("stored_offset", sa.BigInteger, nullable=True),
        schema=schema,
    )
    # The retention's DELETE reads by time across groups.
    op.create_index(f"{table_prefix}lag_partition_samples_at", f"{table_prefix}lag_partition_samples", ["at"],
                    schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_index(f"{table_prefix}lag_partition_samples_at", f"{table_prefix}lag_partition_samples", schema=schema)
    op.drop_table(f"{table_prefix}lag_partition_samples", schema=schema)
