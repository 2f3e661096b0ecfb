"""Every status change of a dead letter: who, when, why, and the payload an edited replay ran with.

A row per change (dead -> replayed, discarded or resolved; a failed replay
attempt stays dead), written in the transaction of the change itself. Each
write has a request id: a change whose COMMIT's answer was lost is looked up
by it on a fresh connection. The dead letter's own row keeps the original
message; an edited replay's key and value are kept here.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}dead_letter_history",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("dead_letter_id", sa.Integer, nullable=False),
        sa.Column("consumer_group", sa.String(255), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("from_status", sa.String(16), nullable=False),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("by_user", sa.String(255), nullable=False),
        sa.Column("by_host", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("request_id", sa.String(32), nullable=False),
        sa.Column("edited", sa.Boolean, nullable=False),
        sa.Column("replayed_key", sa.LargeBinary, nullable=True),
        sa.Column("replayed_value", sa.LargeBinary, nullable=True),
        schema=schema,
    )
    op.create_index(f"{table_prefix}dead_letter_history_letter_idx", f"{table_prefix}dead_letter_history",
                    ["dead_letter_id", "id"], schema=schema)
    op.create_index(f"{table_prefix}dead_letter_history_request_idx", f"{table_prefix}dead_letter_history",
                    ["request_id"], schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_table(f"{table_prefix}dead_letter_history", schema=schema)
