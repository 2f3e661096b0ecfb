"""A request id on each reset in the history.

A reset whose COMMIT's answer was lost (the connection cut after the server
committed) is looked up by its request id on a fresh connection: found, it
landed; not found, it did not and may be run again. Older rows keep NULL.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.add_column(f"{table_prefix}offset_history", sa.Column("request_id", sa.String(32), nullable=True),
                  schema=schema)
    op.create_index(f"{table_prefix}offset_history_request_idx", f"{table_prefix}offset_history",
                    ["request_id"], schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_index(f"{table_prefix}offset_history_request_idx", f"{table_prefix}offset_history", schema=schema)
    with op.batch_alter_table(f"{table_prefix}offset_history", schema=schema) as batch:
        batch.drop_column("request_id")
