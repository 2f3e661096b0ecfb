"""What every write on kstore's tables shares: how its transaction begins on SQLite, who and when.

At the bottom of :mod:`kstore.db`: :mod:`kstore.db.store`, :mod:`kstore.db.resets` and
:mod:`kstore.db.deadletters` all write, and none of them builds on another for this.
"""

from __future__ import annotations

import getpass
import socket
from datetime import datetime, timezone

#: Execution option for connections that write kstore's rows: on SQLite their
#: transactions start with BEGIN IMMEDIATE. A deferred transaction that reads first
#: and writes later cannot wait for another writer (SQLite answers "database is
#: locked" at once, busy_timeout or not); an immediate one takes the write lock
#: up front and waits for it. PostgreSQL ignores it.
WRITES = {"kstore_sqlite_begin": "IMMEDIATE"}


def actor() -> tuple[str, str]:
    """Who is acting, for the reset history: (user, host)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return user, socket.gethostname()


def now() -> datetime:
    return datetime.now(timezone.utc)


def aware(stamp: datetime) -> datetime:
    """A time read back from the database, in UTC: SQLite gives back a naive datetime for a time
    written in UTC."""
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=timezone.utc)
