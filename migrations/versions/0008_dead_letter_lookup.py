"""Dead letters found by their message: an index on (group, topic, partition, offset).

A message that fails again while its letter still waits (the worker reprocessing it after
an operator moved the offsets back) updates that letter, counting the attempts, instead of
adding a second letter for the same message: the worker looks it up by the message in the
batch's transaction, through this index.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_index(f"{table_prefix}dead_letters_message_idx", f"{table_prefix}dead_letters",
                    ["consumer_group", "topic", "partition_id", "offset"], schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_index(f"{table_prefix}dead_letters_message_idx", f"{table_prefix}dead_letters", schema=schema)
