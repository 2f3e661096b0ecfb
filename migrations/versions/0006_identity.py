"""The database's identity: one random id, made when kstore's tables are made here.

Workers of one group advertise it to each other through Kafka's group protocol, so a
worker pointed at another database than its group's is refused (one pipeline, one
database), and ``kstore offsets show`` names only owners that write here.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    table = op.create_table(
        f"{table_prefix}identity",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        schema=schema,
    )
    op.bulk_insert(table, [{"id": str(uuid.uuid4()), "created_at": datetime.now(timezone.utc)}])


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_table(f"{table_prefix}identity", schema=schema)
