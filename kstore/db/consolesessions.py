"""The web console's logins (migration 0014): one row per logged-in operator, found by the SHA-256
of the random token its browser holds.

Only the console (:mod:`kstore.console.sessions`) reads or writes them. The token itself is never
stored, so whoever reads the table cannot act as an operator; a row past ``expires_at``, or made
under another console password (``password_check``), is no login.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Column, DateTime, Engine, MetaData, String, Table, Text, delete, insert, select, update

from .writes import WRITES, aware, now


def build_table(prefix: str = "kstore_", schema: str | None = None) -> Table:
    return Table(
        f"{prefix}console_sessions",
        MetaData(schema=schema),
        Column("token_sha256", String(64), primary_key=True),
        Column("operator", String(255), nullable=False),
        Column("csrf", String(64), nullable=False),
        Column("password_check", String(64), nullable=True),
        Column("outcome", Text, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("expires_at", DateTime(timezone=True), nullable=False),
    )


@dataclass(frozen=True)
class Login:
    """A live login: who, its CSRF token and the outcomes of its actions waiting to be shown (JSON text
    of a mapping from each action's id, or None)."""

    operator: str
    csrf: str
    outcome: str | None


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Logins:
    """The logins of one console's database."""

    def __init__(self, engine: Engine, table: Table) -> None:
        self.engine, self.table = engine, table

    def create(self, operator: str, csrf: str, password_check: str | None, lifetime: timedelta,
               outcome: str | None = None) -> str:
        """A new login for ``operator``: the token for its cookie. Expired logins are deleted on the way."""
        token = secrets.token_urlsafe(32)
        at = now()
        with self.engine.begin() as conn:
            conn.execute(delete(self.table).where(self.table.c.expires_at < at))
            conn.execute(insert(self.table).values(
                token_sha256=_key(token), operator=operator, csrf=csrf, password_check=password_check,
                outcome=outcome, created_at=at, expires_at=at + lifetime))
        return token

    def find(self, token: str, password_check: str | None) -> Login | None:
        """The login of ``token``, or None: unknown, logged out, expired, or made under another password."""
        t = self.table
        with self.engine.connect() as conn:
            row = conn.execute(select(t.c.operator, t.c.csrf, t.c.password_check, t.c.outcome, t.c.expires_at)
                               .where(t.c.token_sha256 == _key(token))).first()
        if row is None or aware(row.expires_at) <= now() or row.password_check != password_check:
            return None
        return Login(row.operator, row.csrf, row.outcome)

    def change_outcomes(self, token: str, added: Mapping[str, Any], shown: Iterable[str], keep: int) -> None:
        """Add the outcomes of actions (by id) and drop those a page showed, keeping the newest ``keep``.

        Merged under the row's lock with what other requests of the login wrote meanwhile: two tabs
        acting at once each find their own outcome."""
        t = self.table
        with self.engine.connect() as conn:
            conn.execution_options(**WRITES).begin()  # on SQLite, BEGIN IMMEDIATE: the merge is serialised
            found = conn.execute(select(t.c.outcome).where(t.c.token_sha256 == _key(token))
                                 .with_for_update()).first()
            if found is None:
                return
            outcomes: dict[str, Any] = json.loads(found.outcome) if found.outcome else {}
            for done in shown:
                outcomes.pop(done, None)
            outcomes.update(added)
            kept = dict(list(outcomes.items())[-keep:])
            conn.execute(update(t).where(t.c.token_sha256 == _key(token))
                         .values(outcome=json.dumps(kept) if kept else None))
            conn.commit()

    def end(self, token: str) -> None:
        """Log ``token`` out: its cookie is no login from now on, wherever it is sent."""
        with self.engine.begin() as conn:
            conn.execute(delete(self.table).where(self.table.c.token_sha256 == _key(token)))
