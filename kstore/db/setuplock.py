"""One processor ``setup()`` at a time per group: a PostgreSQL advisory lock around it.

Workers of a group that start together all run their processor's ``setup()``, and that is
where users create their tables. PostgreSQL's ``CREATE TABLE IF NOT EXISTS`` (or ``CREATE TYPE``,
``CREATE INDEX IF NOT EXISTS``) is not safe against itself: two sessions that both find the name
free both insert it into the catalog, and one fails with a unique violation on
``pg_type_typname_nsp_index``. Holding the group's lock around ``setup()`` makes the second
worker run its DDL after the first committed, when the names exist.

The lock is a session-level advisory lock taken on a connection of its own in autocommit mode,
so it never sits inside the processor's transactions (and an idle-in-transaction timeout never
ends it), and it goes with the session if the process dies. SQLite serializes writers anyway:
no lock there.

Invariants: the lock is released when ``setup()`` returns or raises; a connection whose unlock
failed is never handed back to the pool (it is invalidated, which ends the session and so the lock).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, text

from .sqlerrors import first_line

log = logging.getLogger(__name__)

#: How long to wait between two tries of a lock another worker holds: setups are short.
SETUP_LOCK_POLL_S = 0.05


def setup_lock_key(group: str) -> int:
    """The advisory lock's key for ``group``: a stable 64-bit hash (Python's ``hash`` changes
    from one process to the next), in a namespace of its own so no other use of advisory locks
    on the database collides with it by accident."""
    digest = hashlib.blake2b(f"kstore.setup:{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@contextmanager
def setup_lock(engine: Engine, group: str) -> Iterator[None]:
    """Hold the group's setup lock (on PostgreSQL) for the length of the ``with`` block."""
    if engine.dialect.name != "postgresql":
        yield
        return
    key = setup_lock_key(group)
    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    try:
        _acquire(conn, key, group)
    except BaseException:
        conn.invalidate()
        conn.close()
        raise
    try:
        yield
    finally:
        _release(conn, key)


def _acquire(conn: Connection, key: int, group: str) -> None:
    """Try the lock until it is ours. A loop of ``pg_try_advisory_lock`` rather than a blocking
    ``pg_advisory_lock``: every round trip stays short (kstore's deadline per round trip holds),
    and the wait is said once in the log."""
    said = False
    while not conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar_one():
        if not said:
            log.info("waiting for another worker of group %r to finish its processor's setup()", group)
            said = True
        time.sleep(SETUP_LOCK_POLL_S)


def _release(conn: Connection, key: int) -> None:
    try:
        released = conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key}).scalar_one()
    except Exception as exc:  # the session ends with the connection, and the lock with it
        log.warning("could not release the setup lock (%s); closing its connection instead", first_line(exc))
        conn.invalidate()
    else:
        if not released:
            conn.invalidate()  # not ours any more (a new session after a reconnect): never pool it
    finally:
        conn.close()
