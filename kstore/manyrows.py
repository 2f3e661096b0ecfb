"""Many rows of one Core INSERT on psycopg2 or psycopg 3, as one multi-row statement quoted by the driver.

``session.execute(insert(table), rows)`` (and the one-row INSERTs the batch
session deferred) would take SQLAlchemy's "insertmanyvalues": it renders the
statement with a numbered parameter per row and column and hands psycopg2 one
dict of them all, which costs about twice the CPU per row of what a hand-written
loop does with ``psycopg2.extras.execute_values``: the driver quotes each row
against a one-row template, in C, and the rows are joined. This module does the
latter, from SQLAlchemy's own compilation of the statement:

- the statement is compiled once per (statement, parameter names), as SQLAlchemy
  would for an executemany, and its one-row ``VALUES (...)`` is the template;
- only a plain INSERT qualifies: every bound parameter is one of the rows' keys
  (no Python-side column default, no embedded values), no RETURNING, no upsert
  (SQLAlchemy does not compile those for insertmanyvalues either), nothing
  escaped; anything else returns None and the caller runs SQLAlchemy's own path
  (for an upsert on kstore's engine: psycopg2's execute_batch, pages of 500);
- the columns' bind processors run as SQLAlchemy would run them (JSON, Enum, a
  TypeDecorator...), except ``LargeBinary``'s, which only wraps bytes in
  ``psycopg2.Binary``: psycopg2 quotes bytes the same way unwrapped;
- the statement goes through ``Connection.exec_driver_sql``, so it is in the
  connection's transaction, events see it, and errors are SQLAlchemy's.

A ``text()`` INSERT deferred by the batch session qualifies the same way when it ends with
its one ``VALUES (...)`` row (so no ``ON CONFLICT``: those go as execute_batch pages).

On psycopg 3, which binds parameters on the server, the rows are quoted by its
``ClientCursor`` (psycopg's own client-side binding) the same way: SQLAlchemy leaves an
INSERT without RETURNING to psycopg 3's ``executemany``, one pipelined INSERT per row,
about twice the CPU.

All rows go in one statement, so the result's ``rowcount`` is that of all of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import repeat
from typing import Any

from sqlalchemy import Connection, CursorResult, Insert, LargeBinary, TextClause

#: (statement cache key, parameter names) -> (SQL before the rows, one row's template, SQL after), or None.
_Plan = tuple[str, str, str, dict[str, Callable[[Any], Any]]]
_PLANS: dict[Any, _Plan | None] = {}
_NO_PARAMETERS = {"no_parameters": True}
_DRIVERS = ("psycopg2", "psycopg")


def execute_many(conn: Connection, statement: Insert, rows: Sequence[dict[str, Any]]) -> CursorResult[Any] | None:
    """Run ``statement`` for ``rows`` as one multi-row INSERT, or return None (nothing sent) if
    it does not qualify (see the module's docstring) or the rows' keys differ."""
    dialect = conn.dialect
    if dialect.driver not in _DRIVERS or statement._returning or statement._return_defaults or not rows:
        return None
    keys = _same_keys(rows)
    cache_key = statement._generate_cache_key()
    if keys is None or cache_key is None:
        return None
    # The key alone, as SQLAlchemy's own compiled cache does: statements that differ only by
    # embedded values share it, and never qualify (their values are parameters not in ``keys``).
    plan = _cached((cache_key.key, keys), lambda: _plan(statement, keys, conn))
    return None if plan is None else _run(conn, plan, rows)


def _same_keys(rows: Sequence[dict[str, Any]]) -> tuple[str, ...] | None:
    """The rows' parameter names, if every row is a dict with the same ones."""
    names = rows[0].keys()
    for row in rows:
        if type(row) is not dict or row.keys() != names:
            return None
    return tuple(names)


def _cached(key: Any, make: Callable[[], _Plan | None]) -> _Plan | None:
    try:
        return _PLANS[key]
    except KeyError:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        plan = _PLANS[key] = make()
        return plan


def execute_many_text(conn: Connection, statement: TextClause,
                      rows: Sequence[dict[str, Any]]) -> CursorResult[Any] | None:
    """The same for a ``text("INSERT INTO t (...) VALUES (:a, :b, ...)")`` that ends with its one
    VALUES row (no nested parentheses or quotes in it, every parameter in it), or None."""
    if conn.dialect.driver not in _DRIVERS or not rows:
        return None
    keys = _same_keys(rows)
    if keys is None:
        return None
    types = tuple((k, type(b.type)) for k, b in statement._bindparams.items())
    plan = _cached((statement.text, keys, types), lambda: _text_plan(statement, keys, conn))
    return None if plan is None else _run(conn, plan, rows)


#: ``VALUES (...)`` at the very end: parameters (``%(name)s``) and anything but parentheses, quotes
#: and percent signs between them.
_LAST_VALUES_ROW = re.compile(r"\bVALUES\s*(\((?:[^()'\"%]|%\(\w+\)s)*\))\s*$", re.IGNORECASE)


def _text_plan(statement: TextClause, keys: tuple[str, ...], conn: Connection) -> _Plan | None:
    if any(b.value is not None or b.callable is not None for b in statement._bindparams.values()):
        return None  # values bound in the statement itself
    compiled: Any = statement.compile(dialect=conn.dialect)
    if not _binds_are(compiled, keys):
        return None
    return _finish(compiled, _ending_row(compiled.string))


def _binds_are(compiled: Any, keys: tuple[str, ...]) -> bool:
    """Every bound parameter of ``compiled`` is one of the rows' keys, named as they are."""
    return not compiled.escaped_bind_names and set(compiled.binds) == set(keys) and not compiled.positional


def _ending_row(sql: str) -> tuple[str, str, str] | None:
    """``sql`` split around the one VALUES row it ends with, or None."""
    found = _LAST_VALUES_ROW.search(sql)
    return None if found is None else (sql[:found.start(1)], found.group(1), "")


def _finish(compiled: Any, split: tuple[str, str, str] | None) -> _Plan | None:
    """The plan, unless there is no row to repeat or the SQL around it has a (doubled) literal
    percent sign, which would have to be undone for a statement sent without parameters."""
    if split is None or "%" in split[0] or "%" in split[2]:
        return None
    head, row, tail = split
    return head, row, tail, {
        name: process for name, process in compiled._bind_processors.items()
        if not isinstance(compiled.binds[name].type, LargeBinary)
    }


def _run(conn: Connection, plan: _Plan, rows: Sequence[dict[str, Any]]) -> CursorResult[Any]:
    head, template, tail, processors = plan
    if processors:
        rows = [_processed(row, processors) for row in rows]
    dbapi: Any = conn.connection.dbapi_connection
    if conn.dialect.driver == "psycopg":
        # psycopg 3 binds on the server; its ClientCursor quotes on the client, as psycopg2 does.
        import psycopg

        with psycopg.ClientCursor(dbapi) as cur:
            sql = head + ",".join(map(cur.mogrify, repeat(template), rows)) + tail
        with _never_prepared(dbapi):
            return conn.exec_driver_sql(sql, execution_options=_NO_PARAMETERS)
    with dbapi.cursor() as cur:
        values = b",".join(map(cur.mogrify, repeat(template), rows))
    sql = head + values.decode(connection_encoding(conn)) + tail
    return conn.exec_driver_sql(sql, execution_options=_NO_PARAMETERS)


@contextmanager
def _never_prepared(dbapi: Any) -> Iterator[None]:
    """A one-off text, so never to be prepared; and not to be counted either: psycopg 3 keeps the
    texts of its last 100 statements to decide what to prepare (100 MB of these)."""
    threshold, dbapi.prepare_threshold = dbapi.prepare_threshold, None
    try:
        yield
    finally:
        dbapi.prepare_threshold = threshold


def connection_encoding(conn: Connection) -> str:
    """The Python codec of ``conn``'s client encoding, on psycopg2 or psycopg 3."""
    dbapi: Any = conn.connection.dbapi_connection
    if conn.dialect.driver == "psycopg":
        return str(dbapi.info.encoding)
    import psycopg2.extensions

    return str(psycopg2.extensions.encodings.get(dbapi.encoding, "utf-8"))


def _processed(row: dict[str, Any], processors: dict[str, Callable[[Any], Any]]) -> dict[str, Any]:
    out = dict(row)
    for name, process in processors.items():
        out[name] = process(out[name])
    return out


def _plan(statement: Insert, keys: tuple[str, ...], conn: Connection) -> _Plan | None:
    if statement._multi_values or statement.select is not None or "%" in "".join(keys):
        return None
    compiled: Any = statement.compile(dialect=conn.dialect, column_keys=list(keys), for_executemany=True)
    if not _binds_are(compiled, keys):
        return None
    sql: str = compiled.string
    many = compiled._insertmanyvalues
    if many is None:
        # psycopg 3's dialect compiles no insertmanyvalues for an INSERT without RETURNING (it
        # leaves executemany to the driver): a plain INSERT ends with its one-row VALUES.
        if getattr(statement, "_post_values_clause", None) is not None:
            return None  # ON CONFLICT ...
        return _finish(compiled, _ending_row(sql))
    if many.is_default_expr or many.has_upsert_bound_parameters:
        return None
    row = f"({many.single_values_expr})"
    at = sql.find(row)
    if at < 0 or sql.find(row, at + 1) >= 0:
        return None
    return _finish(compiled, (sql[:at], row, sql[at + len(row):]))
