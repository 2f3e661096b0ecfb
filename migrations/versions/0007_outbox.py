"""The outbox: records a batch produces, written in its transaction, published by a relay.

- ``outbox``: one row per produced record, keyed ``(consumer_group, shard, seq)``; ``seq``
  counts in commit order within a shard (taken under the shard's row lock at the batch's end).
- ``outbox_shards``: each shard's next ``seq`` (the row batches lock while they commit).
- ``outbox_relays``: each shard's relay (owner, epoch, lease) and how far it published.
- ``outbox_members``: the relays alive for a group, so they share the shards evenly.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}outbox",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("shard", sa.Integer, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition_id", sa.Integer, nullable=True),
        sa.Column("key", sa.LargeBinary, nullable=True),
        sa.Column("value", sa.LargeBinary, nullable=True),
        sa.Column("headers", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        schema=schema,
    )
    op.create_table(
        f"{table_prefix}outbox_shards",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("next_seq", sa.BigInteger, nullable=False),
        # Made anew with the group's shards: the relays' progress marks in Kafka carry it, so a mark
        # left by shards made before (deleted since, or in another database) counts for nothing.
        sa.Column("incarnation", sa.String(32), nullable=False),
        schema=schema,
    )
    op.create_table(
        f"{table_prefix}outbox_relays",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("lease_until", sa.Float, nullable=False),
        sa.Column("published_seq", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        schema=schema,
    )
    op.create_table(
        f"{table_prefix}outbox_members",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("member", sa.String(255), primary_key=True),
        sa.Column("seen_until", sa.Float, nullable=False),
        schema=schema,
    )


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    for name in ("outbox_members", "outbox_relays", "outbox_shards", "outbox"):
        op.drop_table(f"{table_prefix}{name}", schema=schema)
