"""Commits in doubt: a COMMIT that raised may have landed all the same.

When the connection is cut after the server committed, the COMMIT's answer is
lost and the client sees an error like any other. Assuming it failed would
apply the write twice on a retry (a ``--shift-by`` shifting twice, a dead letter's
effects landing twice); assuming it landed could lose it. So kstore never
assumes: it reads the write back on a fresh connection. Landed: carry on as if
the COMMIT had answered. Not landed: the COMMIT's own error is raised and the
caller may retry. The read back failing too: :class:`CommitInDoubtError`, which
tells the operator what to check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import Connection, text

from kstore.errors import CommitInDoubtError

from .sqlerrors import first_line

log = logging.getLogger(__name__)

#: Reads of a lost COMMIT's outcome before giving up (the database may be restarting).
READ_BACK_ATTEMPTS = 5
#: Pause after the first failed read back, doubled after each (0.2 + 0.4 + 0.8 + 1.6 s).
READ_BACK_DELAY_S = 0.2
#: PostgreSQL: how long one read back waits for the lost transaction's row locks.
READ_BACK_LOCK_TIMEOUT_MS = 5_000


def commit(conn: Connection, landed: Callable[[], bool], what: str, check: str) -> None:
    """Commit ``conn``'s transaction; if the COMMIT raises, find out whether it landed.

    ``landed`` reads the write back on a fresh connection (see :func:`wait_for_locks`).
    Returns normally if the COMMIT answered or the write is found; re-raises the
    COMMIT's error if it is not found. ``what`` names the write and ``check`` tells
    an operator how to see it, for the :class:`CommitInDoubtError` message.
    """
    try:
        conn.commit()
    except Exception as exc:
        # Its session is in an unknown state: drop it, which also ends the transaction
        # (and releases its locks) on the server if the COMMIT never got there.
        conn.invalidate()
        if not _read_back(landed, what, check, exc):
            # Not a warning: the caller reports the error raised here.
            log.debug("%s did not land (its COMMIT failed: %s)", what, first_line(exc))
            raise
        log.warning("%s: the answer to its COMMIT was lost (%s), but reading it back shows it landed",
                    what, first_line(exc))


def _read_back(landed: Callable[[], bool], what: str, check: str, lost: Exception) -> bool:
    delay = READ_BACK_DELAY_S
    for attempt in range(1, READ_BACK_ATTEMPTS + 1):
        try:
            return landed()
        except Exception as exc:
            if attempt == READ_BACK_ATTEMPTS:
                raise CommitInDoubtError(
                    f"{what} may or may not have landed: the answer to its COMMIT was lost ({first_line(lost)}) "
                    f"and reading it back failed {attempt} times ({first_line(exc)}); check {check} before retrying"
                ) from exc
            # Debug only: if every attempt fails, the error raised says it all, on one line.
            log.debug("%s: could not read back whether it landed (%s); again in %.1fs", what, first_line(exc), delay)
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def wait_for_locks(conn: Connection) -> None:
    """Make this read-back transaction's locking reads wait for a lost COMMIT, within a bound.

    If the server received the COMMIT, it may still be applying it when the read
    back starts: a plain read would not see it yet and would report "not landed"
    while it lands a moment later, and a retry would apply it twice. The lost
    transaction holds its rows' locks until it commits or aborts, so the read back
    takes the same locks (``FOR UPDATE``; on SQLite, ``BEGIN IMMEDIATE`` and the
    busy timeout do it) and waits for the outcome, at most ``READ_BACK_LOCK_TIMEOUT_MS``
    at a time (a failed read is retried, then the write is in doubt).
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT set_config('lock_timeout', :ms, true)"),
                     {"ms": f"{READ_BACK_LOCK_TIMEOUT_MS}ms"})
