"""What every write on kstore's tables shares: how its transaction begins on SQLite, who and when.

At the bottom of :mod:`kstore.db`: :mod:`kstore.db.store`, :mod:`kstore.db.resets` and
:mod:`kstore.db.deadletters` all write, and none of them builds on another for this.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone

#: Execution option for connections that write kstore's rows: on SQLite their
#: transactions start with BEGIN IMMEDIATE. A deferred transaction that reads first
#: and writes later cannot wait for another writer (SQLite answers "database is
#: locked" at once, busy_timeout or not); an immediate one takes the write lock
#: up front and waits for it. PostgreSQL ignores it.
WRITES = {"kstore_sqlite_begin": "IMMEDIATE"}


#: The person a write is done for, when it is not this process's user: the web console's operator.
_OPERATOR: ContextVar[str | None] = ContextVar("kstore_operator", default=None)


@contextmanager
def acting_as(operator: str) -> Iterator[None]:
    """Record ``operator`` as who acts in every history row written inside (in this thread or task):
    the web console acts for the person logged in, not for the user its process runs as."""
    token = _OPERATOR.set(operator)
    try:
        yield
    finally:
        _OPERATOR.reset(token)


def actor() -> tuple[str, str]:
    """Who is acting, for the histories: (user, host); the user is the operator of :func:`acting_as` inside one."""
    operator = _OPERATOR.get()
    if operator is not None:
        return operator[:255], socket.gethostname()
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
