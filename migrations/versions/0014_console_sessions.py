"""The web console's logins, kept on the server: a row per logged-in operator.

The browser holds only a random token; the row (found by the token's SHA-256) holds who logged in,
the login's CSRF token, the outcome of the last action to show, and when the login ends. Logging
out deletes the row, so a copied cookie stops working at once, on every console of the database.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.create_table(
        f"{table_prefix}console_sessions",
        sa.Column("token_sha256", sa.String(64), primary_key=True),
        sa.Column("operator", sa.String(255), nullable=False),
        sa.Column("csrf", sa.String(64), nullable=False),
        sa.Column("password_check", sa.String(64), nullable=True),
        sa.Column("outcome", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        schema=schema,
    )
    # Expired logins are deleted by time at each new login.
    op.create_index(f"{table_prefix}console_sessions_expires", f"{table_prefix}console_sessions", ["expires_at"],
                    schema=schema)


def downgrade(table_prefix: str = "kstore_", schema: str | None = None) -> None:
    op.drop_index(f"{table_prefix}console_sessions_expires", f"{table_prefix}console_sessions", schema=schema)
    op.drop_table(f"{table_prefix}console_sessions", schema=schema)
