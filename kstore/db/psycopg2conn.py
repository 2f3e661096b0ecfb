"""kstore's psycopg2 cursor and connection classes (see :mod:`kstore.db.dbapi`, which says what they do).

A module of their own because they subclass psycopg2's: imported only when an engine for a
``postgresql+psycopg2://`` DSN is made, so kstore runs without psycopg2 installed (SQLite, or
PostgreSQL through psycopg 3).
"""

from __future__ import annotations

from typing import Any

import psycopg2.extensions

from .dbapi import RefusedInBatch, prefixed, round_trip_deadline, take_begin

_IDLE = psycopg2.extensions.TRANSACTION_STATUS_IDLE


def _idle(conn: Any) -> bool:
    """Whether the server is outside any transaction (False when that cannot be told: a broken
    connection raises its own error, which must not be hidden by this one)."""
    try:
        return bool(conn.info.transaction_status == _IDLE)
    except psycopg2.Error:
        return False


class Psycopg2Cursor(psycopg2.extensions.cursor):  # type: ignore[misc]
    def _begin_alone(self) -> None:
        begin = take_begin(self.connection)
        if begin is not None:
            with self.connection.cursor() as cur:
                cur.execute(begin)

    def execute(self, query: Any, vars: Any = None) -> Any:
        conn = self.connection
        if self.name is not None and conn.kstore_in_batch:
            # A named (server-side) cursor: psycopg2 refuses one in autocommit mode unless it is WITH
            # HOLD, though the server is inside kstore's transaction; and it wraps the query in DECLARE.
            self.withhold = True
            self._begin_alone()
        elif conn.kstore_begin is not None:
            query = prefixed(take_begin(conn) or "", query, self)
        try:
            with round_trip_deadline(conn):
                return super().execute(query, vars)
        finally:
            # Inside kstore's own transaction, a statement that leaves the server idle ended it.
            if conn.kstore_in_batch and conn.kstore_begin is None and not conn.closed and _idle(conn):
                conn.kstore_ended = True

    def _after_begin_alone(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call`` (one of psycopg2's own), after the batch's BEGIN as a message of its own."""
        self._begin_alone()
        with round_trip_deadline(self.connection):
            return call(*args, **kwargs)

    def executemany(self, query: Any, vars_list: Any) -> Any:
        return self._after_begin_alone(super().executemany, query, vars_list)

    def callproc(self, procname: Any, parameters: Any = None) -> Any:
        return self._after_begin_alone(super().callproc, procname, parameters)

    def copy_expert(self, sql: Any, file: Any, size: int = 8192) -> Any:
        # session.copy_rows (kstore/db/copy.py): the BEGIN goes in front of the COPY, one message, as
        # for execute; the server starts the COPY after it, and psycopg2 answers the COPY's count.
        conn = self.connection
        if conn.kstore_begin is not None:
            sql = prefixed(take_begin(conn) or "", sql, self)
        with round_trip_deadline(conn):
            return super().copy_expert(sql, file, size)

    # copy_from and copy_to build their COPY in C, past copy_expert: their BEGIN goes alone.

    def copy_from(self, *args: Any, **kwargs: Any) -> Any:
        return self._after_begin_alone(super().copy_from, *args, **kwargs)

    def copy_to(self, *args: Any, **kwargs: Any) -> Any:
        return self._after_begin_alone(super().copy_to, *args, **kwargs)


class Psycopg2Connection(RefusedInBatch, psycopg2.extensions.connection):  # type: ignore[misc]
    kstore_timeout_s = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor_factory = Psycopg2Cursor

    def commit(self) -> None:
        with round_trip_deadline(self):
            super().commit()  # refused inside a batch (RefusedInBatch), else psycopg2's

    def rollback(self) -> None:
        with round_trip_deadline(self):
            super().rollback()


def psycopg2_connection_class(timeout_s: float) -> type[Any]:
    """kstore's psycopg2 connection class (see :mod:`kstore.db.dbapi`); ``timeout_s`` 0: no deadline."""
    return type("KstoreConnection", (Psycopg2Connection,), {"kstore_timeout_s": timeout_s})
