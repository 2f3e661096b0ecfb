"""The relay's LISTEN connection (PostgreSQL): woken by a writer that took a shard's ``wake_seq``."""

from __future__ import annotations

import logging
from select import select as readable
from typing import Any, cast

from sqlalchemy import Engine

from .tables import CHANNEL

log = logging.getLogger(__name__)


class Listener:
    """A PostgreSQL connection that LISTENs on :data:`CHANNEL`: :meth:`wait` returns when a transaction
    that took a shard's ``wake_seq`` committed (any group's: a spurious wake-up costs one query)."""

    def __init__(self, engine: Engine) -> None:
        self._raw = engine.raw_connection()
        self._conn: Any = cast(Any, self._raw.driver_connection)
        self._psycopg2 = engine.dialect.driver == "psycopg2"
        if self._psycopg2:
            self._conn.autocommit = True
            with self._conn.cursor() as cur:
                cur.execute(f"LISTEN {CHANNEL}")
        else:
            self._conn.autocommit = True
            self._conn.execute(f"LISTEN {CHANNEL}")

    def wait(self, timeout_s: float) -> bool:
        """True if a notification came within ``timeout_s``."""
        if self._psycopg2:
            conn = self._conn
            conn.poll()
            if not conn.notifies and readable([conn], [], [], timeout_s)[0]:
                conn.poll()
            got = bool(conn.notifies)
            conn.notifies.clear()
            return got
        return any(True for _ in self._conn.notifies(timeout=timeout_s, stop_after=1))

    def close(self) -> None:
        """Drop the connection (never back into the pool: it LISTENs); a dead one is no error."""
        try:
            self._raw.invalidate()
            self._raw.close()
        except Exception as exc:
            log.debug("closing the LISTEN connection failed: %s", exc)
