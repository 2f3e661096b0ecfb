"""The psycopg2 batch connection's BEGIN, sent with the batch's first round trip (kstore/db/dbapi.py).

A fast path, so tested against the plain path: whatever the first round trip of a batch is (a
Core statement, a raw cursor's execute with or without parameters, bytes or a composed query, an
executemany, a stored procedure call, a COPY of each of psycopg2's three kinds, a named cursor), it
runs inside the batch's transaction exactly as it would after a BEGIN of its own: the same result,
and undone by a rollback. Real PostgreSQL.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2.extensions
import psycopg2.sql
import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.dbapi import BEGIN_BATCH, in_batch
from kstore.db.store import make_engine
from tests.support.harness import with_driver


@pytest.fixture
def engine(pg_dsn: str) -> Iterator[sa.Engine]:
    engine = make_engine(Settings(dsn=with_driver(pg_dsn, "psycopg2")))
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE firsts (a int, b text)")
        conn.exec_driver_sql("CREATE FUNCTION add_first(x int) RETURNS int AS "
                             "$$ INSERT INTO firsts VALUES (x, 'proc') RETURNING a $$ LANGUAGE sql")
    yield engine
    engine.dispose()


def _core(conn: sa.Connection, raw: Any) -> Any:
    return conn.execute(sa.text("INSERT INTO firsts VALUES (:a, :b) RETURNING a"), {"a": 1, "b": "x;--y"}).scalar()


def _execute_params(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.execute("INSERT INTO firsts VALUES (%s, %s) RETURNING b", (2, "50%; -- not a comment"))
        return cur.fetchone()


def _execute_bytes(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.execute(b"INSERT INTO firsts VALUES (3, 'bytes')")
        return cur.rowcount


def _composed(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.execute(psycopg2.sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(psycopg2.sql.Identifier("firsts")),
                    (4, "composed"))
        return cur.rowcount


def _executemany(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.executemany("INSERT INTO firsts VALUES (%s, %s)", [(5, "m"), (6, "n")])
        return cur.rowcount


def _callproc(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.callproc("add_first", (7,))
        return cur.fetchone()


def _copy(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.copy_expert("COPY firsts FROM STDIN", io.StringIO("8\tcopied\n9\tcopied\n"))
        return cur.rowcount


def _copy_from(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.copy_from(io.StringIO("12\tfrom\n13\tfrom\n"), "firsts", columns=("a", "b"))
        return cur.rowcount


def _copy_to(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        out = io.StringIO()
        cur.copy_to(out, "firsts")  # reads (nothing yet), then a write: both in the transaction
        cur.execute("INSERT INTO firsts VALUES (14, 'after copy_to')")
        return out.getvalue()


def _named_cursor(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.execute("INSERT INTO firsts VALUES (10, 'before the named cursor')")
    with raw.cursor(name="reader") as cur:
        cur.execute("SELECT a FROM firsts ORDER BY a")
        return cur.fetchall()


def _comment_last(conn: sa.Connection, raw: Any) -> Any:
    with raw.cursor() as cur:
        cur.execute("INSERT INTO firsts VALUES (11, 'x') -- a trailing comment")
        return cur.rowcount


FIRSTS: dict[str, Callable[[sa.Connection, Any], Any]] = {
    "core": _core, "execute_params": _execute_params, "execute_bytes": _execute_bytes, "composed": _composed,
    "executemany": _executemany, "callproc": _callproc, "copy": _copy, "copy_from": _copy_from,
    "copy_to": _copy_to, "named_cursor": _named_cursor,
    "comment_last": _comment_last,
}


def _run(engine: sa.Engine, first: Callable[[sa.Connection, Any], Any], lazy: bool) -> tuple[Any, list[Any]]:
    """``first`` as a batch's first round trip, with kstore's lazy BEGIN or a BEGIN of its own before
    it; then what the transaction sees, then a rollback: what it returned, and what it saw."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        raw = conn.connection.dbapi_connection
        with conn.begin():
            if not lazy:
                conn.exec_driver_sql(BEGIN_BATCH)
            with in_batch(raw, BEGIN_BATCH if lazy else None):
                result = first(conn, raw)
                assert raw.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_INTRANS
                seen = conn.exec_driver_sql(
                    "SELECT a, b, current_setting('kstore.batch', true) FROM firsts ORDER BY a, b").all()
            conn.exec_driver_sql("ROLLBACK")
    return result, [tuple(r) for r in seen]


@pytest.mark.parametrize("name", sorted(FIRSTS))
def test_the_batchs_first_round_trip_runs_inside_its_transaction_as_after_a_begin_of_its_own(
        engine: sa.Engine, name: str) -> None:
    first = FIRSTS[name]
    plain = _run(engine, first, lazy=False)
    lazy = _run(engine, first, lazy=True)
    assert lazy == plain
    assert plain[1], "the first round trip wrote nothing"
    assert all(row[2] == "on" for row in plain[1])  # seen inside the batch's transaction
    with engine.connect() as conn:  # both rolled back: nothing of either ran outside it
        assert conn.exec_driver_sql("SELECT count(*) FROM firsts").scalar() == 0


def test_a_batch_that_never_touched_the_database_leaves_no_begin_for_the_next_user(engine: sa.Engine) -> None:
    """A batch that failed before its first round trip returns its connection to the pool with its
    BEGIN unsent; the next user (a claim, say) must not have it prefixed to its own statement."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        raw = conn.connection.dbapi_connection
        with pytest.raises(RuntimeError), in_batch(raw, BEGIN_BATCH):
            raise RuntimeError("the processor failed before it touched the database")
    with engine.connect() as conn:
        assert conn.connection.dbapi_connection is raw
        assert conn.exec_driver_sql("SELECT current_setting('kstore.batch', true)").scalar() in (None, "")
