"""What a database error says: whether it is the database's (retry later) or the batch's, and its message.

Pure functions of an exception (SQLAlchemy's, wrapping psycopg2's, psycopg 3's or sqlite3's),
at the bottom of :mod:`kstore.db` so that every module, :mod:`kstore.db.indoubt` too, can
name an error in one line without building on :mod:`kstore.db.store`.
"""

from __future__ import annotations

import re

from sqlalchemy.exc import DBAPIError, OperationalError

from kstore.retry import one_line

#: SQLSTATE classes and codes that say "the database, not this batch": connection
#: exceptions (08), transaction rollbacks (40: serialization failure, deadlock), insufficient
#: resources (53), operator intervention (57: shutdown, a cancelled statement, a database that
#: cannot take connections yet), system errors (58: an I/O error), a lock that could not be had
#: (55P03), a read-only transaction (25006: the address now leads to a replica, as after a
#: failover) and a session ended for idling in a transaction (25P03). A failover is an outage,
#: never a bad message. A batch that keeps failing with one of these while the database answers
#: in between is shrunk all the same (kstore.engine.waits), so none of them can stall a pipeline.
_TRANSIENT_SQLSTATES = ("08", "40", "53", "57", "58", "55P03", "25006", "25P03")
#: SQLite's messages for a database that is busy or failing, rather than a bad statement.
_TRANSIENT_SQLITE = ("database is locked", "database table is locked", "disk i/o error", "unable to open")


#: Of those, the ones that describe the database or its other sessions whatever a batch does:
#: a read-only replica, a full disk or too many connections, and contention with another
#: transaction (a serialization failure, a deadlock, a lock not had in time). The database answers
#: a probe meanwhile, yet no batch is to blame: they are retried as they are for as long as they last.
_STATE_SQLSTATES = ("25006", "53", "40", "55P03")


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (psycopg2 or psycopg 3), if it has one."""
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    return str(code) if code else None


def database_state(exc: BaseException) -> bool:
    """True for a transient error that describes the database's state or its other sessions' rather
    than anything a batch did (see :data:`_STATE_SQLSTATES`): :mod:`kstore.engine.waits` never takes it for
    the batch's failure."""
    code = sqlstate(exc)
    return code is not None and code.startswith(_STATE_SQLSTATES)


def transient(exc: BaseException) -> bool:
    """True if ``exc`` says the database is unavailable (retry the same batch later),
    False if it is about what the batch did (a constraint, a missing table, a bad
    statement: the batch's failure, isolated and retried like a processor error).

    Retrying a batch error forever at full size would stall the pipeline; counting a
    database outage against a message would dead-letter good messages.
    """
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    code = sqlstate(exc)
    if code:
        return code.startswith(_TRANSIENT_SQLSTATES)
    if type(orig).__module__.startswith("sqlite3"):
        return any(m in str(orig).lower() for m in _TRANSIENT_SQLITE)
    # A psycopg2 OperationalError without a SQLSTATE comes from the client side: the
    # connection failed or was cut (the server never answered).
    return isinstance(exc, OperationalError)


def first_line(exc: BaseException) -> str:
    """The driver's own message, first line only (SQLAlchemy appends SQL and a URL)."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(orig).__name__


#: A data exception's (SQLSTATE class 22) first line quotes the value it could not take, at its end:
#: ``invalid input syntax for type integer: "..."``.
_QUOTED_VALUE = re.compile(r': ".*"$')


def error_text(exc: BaseException, statement_parameters: bool = False) -> str:
    """An error for a log line: its type and first line (:func:`~kstore.retry.one_line`), so never the
    values a statement carried (SQLAlchemy's ``[SQL: ...]`` and ``[parameters: ...]``, the server's
    ``DETAIL``), nor the value a data exception quotes. ``statement_parameters``: the whole error."""
    if statement_parameters:
        return f"{type(exc).__name__}: {exc}"
    text = one_line(exc)
    code = sqlstate(exc)
    if code is not None and code.startswith("22"):
        text = _QUOTED_VALUE.sub(": (value hidden)", text)
    return text
