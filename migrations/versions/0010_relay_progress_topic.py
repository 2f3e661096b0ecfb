"""The relays keep their progress in a Kafka topic, and wake on a NOTIFY only when they wait.

- ``outbox_relays.lease_until`` is renamed ``lease_expires``. A relay of an earlier version keeps
  its progress as a consumer group's offsets, and cannot read a shard's progress kept in a topic:
  taking a shard it would publish the rows after its older mark again. With the column renamed
  it can neither take nor keep a shard, so once this migration ran only relays that read both
  kinds of marks publish. (Downgrading is safe only while no relay has published since.)
- ``outbox_shards.wake_seq``: the ``seq`` a shard's idle relay waits for. The transaction that
  writes that ``seq`` sends the NOTIFY that wakes it; the others send none (PostgreSQL commits
  NOTIFYing transactions one at a time).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    with op.batch_alter_table(f"{table_prefix}outbox_relays", schema=schema) as batch:
        batch.alter_column("lease_until", new_column_name="lease_expires", existing_type=sa.Float,
                           existing_nullable=False)
    with op.batch_alter_table(f"{table_prefix}outbox_shards", schema=schema) as batch:
        batch.add_column(sa.Column("wake_seq", sa.BigInteger, nullable=True))


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    with op.batch_alter_table(f"{table_prefix}outbox_shards", schema=schema) as batch:
        batch.drop_column("wake_seq")
    with op.batch_alter_table(f"{table_prefix}outbox_relays", schema=schema) as batch:
        batch.alter_column("lease_expires", new_column_name="lease_until", existing_type=sa.Float,
                           existing_nullable=False)
