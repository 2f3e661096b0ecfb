"""A dead letter keeps the error it was dead-lettered with: a failed replay puts its own error in
``error`` and, the first time, moves the original to ``first_error``, so the letter is still found
by the error (and error type) that made it a dead letter. Null while the two are the same.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.add_column(f"{table_prefix}dead_letters", sa.Column("first_error", sa.Text, nullable=True), schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_column(f"{table_prefix}dead_letters", "first_error", schema=schema)
