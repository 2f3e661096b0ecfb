"""The last row Kafka refused in each outbox shard, for the operator's tools.

``outbox_relays.refused_seq``, ``refused_at`` and ``refused_reason``: when a relay stops on a row
Kafka refuses (a record too large for its topic, say), it notes the row's ``seq``, when, and
Kafka's answer in the shard's row. ``kstore outbox show`` and the console's outbox page show it;
publishing does not read it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    with op.batch_alter_table(f"{table_prefix}outbox_relays", schema=schema) as batch:
        batch.add_column(sa.Column("refused_seq", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("refused_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("refused_reason", sa.Text, nullable=True))


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    with op.batch_alter_table(f"{table_prefix}outbox_relays", schema=schema) as batch:
        batch.drop_column("refused_reason")
        batch.drop_column("refused_at")
        batch.drop_column("refused_seq")
