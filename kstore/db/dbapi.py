"""kstore's DBAPI connection classes: what every kstore connection does below SQLAlchemy.

Each driver (psycopg2, psycopg 3, sqlite3) gets a connection class of kstore's own,
installed by :func:`kstore.db.store.make_engine`. It does three things:

- **A deadline per round trip** (:mod:`kstore.db.deadline`), when ``db_timeout_s`` > 0
  (PostgreSQL only).
- **Inside a batch, the connection's own ``commit()`` and ``rollback()`` are refused.**
  A processor (or a library it calls) that reaches the raw DBAPI connection
  (``session.connection().connection``) and commits or rolls back would split the batch's
  one transaction: a rollback loses the effects of earlier messages while kstore still
  commits their offsets, a commit lands effects that a later failure retries. So the call
  raises :class:`BatchTransactionError`, before anything happened, and the batch fails even
  if the processor catches it (see :func:`refusal`).
- **psycopg2's batch transaction begins with the batch's first round trip**, not before the
  processor runs (:func:`enter_batch`). The batch connection is in autocommit mode and kstore
  sends its own ``BEGIN`` (:meth:`kstore.db.store.Store.commit_in_one_round_trip`). Sent before
  ``handle()``, the processor's whole Python time (its deferred INSERTs are only sent at the
  end) would count as "idle in transaction", and past ``idle_in_transaction_timeout_ms`` the
  server would end the session and the batch would fail. So the ``BEGIN`` rides in front of
  the first statement's own message (one simple query: ``BEGIN; SET LOCAL ...; <statement>``,
  a COPY by ``copy_expert`` as ``session.copy_rows`` sends it too; ``copy_from``, ``copy_to``,
  an executemany, a stored procedure call or a named cursor get it as a message of its own just
  before). A
  named (server-side) cursor is declared ``WITH HOLD``: psycopg2 refuses any other in
  autocommit mode, though the server is inside kstore's transaction.

Threading: all of it runs on the thread that uses the connection.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

from .deadline import WATCHDOG

#: What begins a batch's transaction on a psycopg2 batch connection. The setting marks the
#: transaction as the batch's own: the batch's last message checks it (kstore.db.store), so a
#: transaction the processor ended and began again through SQL is never committed as the batch.
BEGIN_BATCH = "BEGIN; SET LOCAL kstore.batch = 'on'"


class BatchTransactionError(Exception):
    """The processor called ``commit()`` or ``rollback()`` on the batch's DBAPI connection.

    Refused: the batch's effects and its offsets commit together, in kstore's one
    transaction. The batch fails (even if this error is caught), and the failing message is
    found, retried and dead-lettered or stops the worker as any failure. Undo part of a batch
    with a savepoint (``with self.session.begin_nested(): ...``).
    """


def enter_batch(dbapi: Any, begin: str | None) -> None:
    """From now on ``dbapi`` belongs to a batch: refuse its commit()/rollback(); with ``begin``,
    send that first, with the next round trip. (A connection not made by kstore's classes,
    say a test's own ``creator``, is left as it is.)"""
    try:
        dbapi.kstore_in_batch = True
        dbapi.kstore_refused = None
        dbapi.kstore_ended = False
        dbapi.kstore_begin = begin
    except AttributeError:
        pass


def leave_batch(dbapi: Any) -> None:
    """The batch's own code is done with ``dbapi``: kstore commits or rolls back now."""
    with suppress(AttributeError):
        dbapi.kstore_in_batch = False


def take_begin(dbapi: Any) -> str | None:
    """The BEGIN still to send, now to be sent by the caller (with its own message)."""
    begin = getattr(dbapi, "kstore_begin", None)
    if begin is not None:
        dbapi.kstore_begin = None
    return begin


def refusal(dbapi: Any) -> BatchTransactionError | None:
    """The commit()/rollback() refused during the batch, if there was one."""
    return getattr(dbapi, "kstore_refused", None)


def ended(dbapi: Any) -> bool:
    """Whether a round trip of the batch left the server outside a transaction: the processor sent
    COMMIT or ROLLBACK through SQL (psycopg2 and psycopg 3; see the classes)."""
    return bool(getattr(dbapi, "kstore_ended", False))


def _refuse(conn: Any, what: str) -> None:
    if conn.kstore_in_batch:
        error = BatchTransactionError(
            f"{what}() on the batch's database connection is refused: it would split the batch's one transaction "
            "(its effects and its offsets commit together), so the batch fails; to undo part of a batch use a "
            "savepoint: with self.session.begin_nested(): ...")
        conn.kstore_refused = error
        raise error


def prefixed(begin: str, query: Any, cursor: Any) -> Any:
    """``query`` (psycopg2's str, bytes or Composable) with the batch's ``begin`` in front, one message."""
    if isinstance(query, bytes):
        return begin.encode() + b"; " + query
    if not isinstance(query, str):
        query = query.as_string(cursor)  # a psycopg2.sql.Composable
    return f"{begin}; {query}"


class RefusedInBatch:
    """A DBAPI connection's batch state (see :func:`enter_batch`), and its commit() and rollback()
    refused inside a batch. First among a connection class's bases."""

    kstore_in_batch = False
    kstore_ended = False
    kstore_refused: BatchTransactionError | None = None
    kstore_begin: str | None = None

    def commit(self) -> None:
        _refuse(self, "commit")
        super().commit()  # type: ignore[misc]

    def rollback(self) -> None:
        _refuse(self, "rollback")
        super().rollback()  # type: ignore[misc]


def round_trip_deadline(conn: Any) -> Any:
    """The deadline of one round trip of ``conn`` (a kstore psycopg2 connection), if it has one."""
    timeout_s = conn.kstore_timeout_s
    return WATCHDOG.guard(conn.fileno(), timeout_s) if timeout_s > 0 else nullcontext()


def psycopg_connection_class(timeout_s: float) -> type[Any]:
    """kstore's psycopg 3 connection class (psycopg2's is :mod:`kstore.db.psycopg2conn`'s). Every blocking
    round trip of a psycopg 3 connection goes through ``Connection.wait`` (execute, executemany, COPY,
    commit, rollback): the deadline is armed there."""
    import psycopg

    idle = psycopg.pq.TransactionStatus.IDLE
    pipeline_off = psycopg.pq.PipelineStatus.OFF

    class Connection(RefusedInBatch, psycopg.Connection):
        def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
            idle_before = self.pgconn.transaction_status == idle
            try:
                with WATCHDOG.guard(self.fileno(), timeout_s) if timeout_s > 0 else nullcontext():
                    return super().wait(gen, *args, **kwargs)
            finally:
                # psycopg begins a transaction before a batch's first statement (in the same round
                # trip): one that leaves the server idle inside a batch ended it (COMMIT through SQL).
                # (A broken connection tells UNKNOWN, never IDLE.) In pipeline mode (an executemany)
                # the status moves only when the server's answers are read, after a sync: a step that
                # found the server idle and left it idle read none (entering the pipeline sends nothing,
                # and psycopg syncs right after the BEGIN it sends), so it says nothing yet.
                if self.kstore_in_batch and self.pgconn.transaction_status == idle and not (
                        idle_before and self.pgconn.pipeline_status != pipeline_off):
                    self.kstore_ended = True

    return Connection


class SQLiteConnection(RefusedInBatch, sqlite3.Connection):
    """The same for SQLite (no deadline: there is no network). A COMMIT through SQL is seen at the
    batch's end: statements after it run outside any transaction (kstore.db.store.check_own_transaction)."""


@contextmanager
def in_batch(dbapi: Any, begin: str | None) -> Iterator[None]:
    """:func:`enter_batch` for the block, :func:`leave_batch` after it, whatever happens."""
    enter_batch(dbapi, begin)
    try:
        yield
    finally:
        leave_batch(dbapi)
