"""Record which worker claimed each partition.

An admin reset bumps the epoch but keeps the owner, so the owning worker can tell
"an operator moved my partition" (adopt the new position) from "another worker
claimed it" (I am a zombie: stop).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.add_column(f"{table_prefix}offsets", sa.Column("owner", sa.String(255), nullable=True), schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    with op.batch_alter_table(f"{table_prefix}offsets", schema=schema) as batch:
        batch.drop_column("owner")
