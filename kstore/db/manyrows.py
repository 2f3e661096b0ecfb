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
  (no Python-side column default, no embedded values), no RETURNING, no upsert,
  nothing escaped; anything else returns None and the caller runs SQLAlchemy's own path;
- an upsert (``ON CONFLICT``) is never one multi-row statement: a key twice among the
  rows fails there ("cannot affect row a second time") where one statement per row
  updates it twice. On psycopg2 it goes as kstore's pages of statements
  (:func:`_run_pages`), on psycopg 3 as its executemany, a statement per row;
- the columns' bind processors run as SQLAlchemy would run them (JSON, Enum, a
  TypeDecorator...), except ``LargeBinary``'s, which only wraps bytes in
  ``psycopg2.Binary``: psycopg2 quotes bytes the same way unwrapped;
- the statement goes through ``Connection.exec_driver_sql``, so it is in the
  connection's transaction, events see it, and errors are SQLAlchemy's;
- the rows of the commonest values are quoted by :mod:`kstore.db.literals`, the driver's
  own literals written without its adapters (see :func:`_quoted`).

A ``text()`` INSERT deferred by the batch session qualifies the same way when it ends with
its one ``VALUES (...)`` row of parameters, constants and casts, found by the text's tokens
(:mod:`kstore.db.sqltext`: comments, literals and dollar quotes cannot fool it); what follows the
row (a comment, a ``;``) is dropped, so a trailing ``-- note`` cannot swallow the rows after
it. Any other one-INSERT text (``ON CONFLICT``, ``INSERT ... SELECT``) goes on psycopg2 as
kstore's pages. (psycopg2's own ``execute_batch`` is never used: it joins statements with
``;`` on one line, where a ``-- note`` silently swallows the rest of its page.)

On psycopg 3, which binds parameters on the server, the rows are quoted on the client the same
way, as its ``ClientCursor`` (psycopg's own client-side binding) quotes them: SQLAlchemy leaves an
INSERT without RETURNING to psycopg 3's ``executemany``, one pipelined INSERT per row,
about twice the CPU.

All rows go in one statement, so the result's ``rowcount`` is that of all of them, and it is
checked: a multi-row INSERT of n rows must report n, a page must end with its sentinel, or
:class:`~kstore.errors.WriteCountError` fails the batch before its commit. The one legitimate
cause of fewer rows is the table's own (a ``BEFORE INSERT`` trigger returning NULL, a rule):
write such a table with ``defer_inserts = False``. Rows sent together differ from the same
statements one by one in two more ways a table can tell: a ``FOR EACH STATEMENT`` trigger
fires once for them, and with two bad rows the error reported may be the later row's (all
rows are quoted and read before any is inserted); the batch fails either way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, CursorResult, Insert, LargeBinary, TextClause
from sqlalchemy.exc import DBAPIError

from kstore.errors import WriteCountError

from . import literals, sqltext

_log = logging.getLogger(__name__)

# SQLAlchemy's private names used here, for want of a public API; tests/unit/db/test_session_sqlalchemy_names.py
# checks that each is still there, and the differential tests (tests/integration/database/test_differential.py) that
# the fast path still writes what SQLAlchemy's own would:
#
# - ``Insert._returning``, ``._return_defaults``, ``._multi_values`` (in execute_many, _plan): as
#   in kstore.db.session, an INSERT that returns rows or writes several is not this module's.
# - ``HasCacheKey._generate_cache_key()`` (in execute_many): the plan cache's key, as
#   SQLAlchemy's own compiled cache keys a statement.
# - ``Insert._post_values_clause`` (in is_upsert): an ``ON CONFLICT`` clause, never one
#   multi-row statement.
# - ``TextClause._bindparams`` (in execute_many_text, _text_plan): a ``text()``'s parameters and
#   their types, for the cache key per call (compiling it to ask would cost more than the rows).
# - ``SQLCompiler._insertmanyvalues`` (in _plan, once per plan): where SQLAlchemy's compilation
#   put the one-row ``VALUES (...)``, including SQL expressions the token reader
#   (kstore.db.sqltext) does not take as a plain row, such as a column's ``default=func.now()``.

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
    plan = _cached(_PLANS, (dialect.driver, cache_key.key, keys), lambda: _plan(statement, keys, conn))
    if plan is None:
        return None
    return _run(conn, plan, rows) if plan[1] else _run_pages(conn, plan, rows)


def is_upsert(statement: Insert) -> bool:
    """An ``INSERT ... ON CONFLICT`` (or any clause after its VALUES): never one multi-row statement,
    which fails on a key written twice ("ON CONFLICT DO UPDATE command cannot affect row a second
    time") where the same rows one by one update it twice."""
    # Private (no public accessor): a SQLAlchemy without it is taken to say "upsert", the safe path
    # (a statement per row); tests/unit/db/test_session_sqlalchemy_names.py fails on it first.
    return getattr(statement, "_post_values_clause", True) is not None


def _same_keys(rows: Sequence[dict[str, Any]]) -> tuple[str, ...] | None:
    """The rows' parameter names, if every row is a dict with the same ones."""
    names = rows[0].keys()
    for row in rows:
        if type(row) is not dict or row.keys() != names:
            return None
    return tuple(names)


_T = TypeVar("_T")


def _cached(cache: dict[Any, _T], key: Any, make: Callable[[], _T]) -> _T:
    """``cache[key]``, made by ``make()`` the first time (at most 256 kept: then it starts afresh)."""
    try:
        return cache[key]
    except KeyError:
        if len(cache) >= 256:
            cache.clear()
        made = cache[key] = make()
        return made


def execute_many_text(conn: Connection, statement: TextClause,
                      rows: Sequence[dict[str, Any]]) -> CursorResult[Any] | None:
    """The same for a ``text("INSERT INTO t (...) VALUES (:a, :b, ...)")`` that ends with its one
    VALUES row (parameters, constants and casts in it, every parameter in it; comments or a ``;``
    after it are dropped), judged by its tokens (:mod:`kstore.db.sqltext`). On psycopg2, any other
    text of one statement (``ON CONFLICT``, ``INSERT ... SELECT``) goes as pages of statements
    (:func:`_run_pages`). Else None: nothing was sent."""
    if conn.dialect.driver not in _DRIVERS or not rows:
        return None
    keys = _same_keys(rows)
    if keys is None:
        return None
    types = tuple((k, type(b.type)) for k, b in statement._bindparams.items())
    plan = _cached(_PLANS, (conn.dialect.driver, statement.text, keys, types),
                   lambda: _text_plan(statement, keys, conn))
    if plan is None:
        return None
    return _run(conn, plan, rows) if plan[1] else _run_pages(conn, plan, rows)


def _text_plan(statement: TextClause, keys: tuple[str, ...], conn: Connection) -> _Plan | None:
    """A multi-row plan; else, on psycopg2, one of pages: (the statement without what follows its
    last token, "", "", processors); else None."""
    if any(b.value is not None or b.callable is not None for b in statement._bindparams.values()):
        return None  # values bound in the statement itself
    compiled: Any = statement.compile(dialect=conn.dialect)
    if not _binds_are(compiled, keys):
        return None
    plan = _finish(compiled, _ending_row(compiled.string))
    if plan is not None or conn.dialect.driver != "psycopg2":
        return plan
    body = sqltext.body_of(compiled.string)
    # Pages are quoted by the driver statement by statement: a literal percent sign is fine.
    return None if body is None else _finish(compiled, (body, "", ""), percent_ok=True)


def _binds_are(compiled: Any, keys: tuple[str, ...]) -> bool:
    """Every bound parameter of ``compiled`` is one of the rows' keys, named as they are."""
    return not compiled.escaped_bind_names and set(compiled.binds) == set(keys) and not compiled.positional


def _ending_row(sql: str) -> tuple[str, str, str] | None:
    """``sql`` split around the one VALUES row it ends with (what follows the row dropped), or None."""
    split = sqltext.ending_values_row(sql)
    return None if split is None else (*split, "")


def _finish(compiled: Any, split: tuple[str, str, str] | None, percent_ok: bool = False) -> _Plan | None:
    """The plan, unless there is no row to repeat or the SQL around it has a (doubled) literal
    percent sign, which would have to be undone for a statement sent without parameters."""
    if split is None or (not percent_ok and ("%" in split[0] or "%" in split[2])):
        return None
    head, row, tail = split
    if compiled.dialect.driver == "psycopg":
        row = _cast_whole(row)  # quoted on the client by ClientCursor (see _run)
    return head, row, tail, _bind_processors(compiled)


def _bind_processors(compiled: Any) -> dict[str, Callable[[Any], Any]]:
    """The columns' bind processors, by parameter name, as SQLAlchemy's executemany would run them
    (from public parts: each bound type's implementation for the dialect), but ``LargeBinary``'s,
    which only wraps bytes in ``psycopg2.Binary`` (psycopg2 quotes bytes the same way unwrapped)."""
    dialect = compiled.dialect
    processors = {}
    for name, bind in compiled.binds.items():
        if isinstance(bind.type, LargeBinary):
            continue
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            processors[name] = process
    return processors


def _run(conn: Connection, plan: _Plan, rows: Sequence[dict[str, Any]]) -> CursorResult[Any]:
    """One multi-row INSERT of ``rows``, whose row count must be theirs (no plan has ON CONFLICT)."""
    head, template, tail, processors = plan
    if processors:
        rows = [_processed(row, processors) for row in rows]
    dbapi: Any = conn.connection.dbapi_connection
    if conn.dialect.driver == "psycopg":
        # psycopg 3 binds on the server; its ClientCursor quotes on the client, as psycopg2 does.
        import psycopg

        with psycopg.ClientCursor(dbapi) as cur, _as_sqlalchemy_errors(conn, template):
            sql = head + ",".join(_quoted(conn, cur, template, rows)) + tail
        with _never_prepared(dbapi):
            result = conn.exec_driver_sql(sql, execution_options=_NO_PARAMETERS)
    else:
        with dbapi.cursor() as cur, _as_sqlalchemy_errors(conn, template):
            sql = head + ",".join(_quoted(conn, cur, template, rows)) + tail
        result = conn.exec_driver_sql(sql, execution_options=_NO_PARAMETERS)
    if result.rowcount != len(rows):
        raise WriteCountError(
            f"a multi-row INSERT of {len(rows)} rows ({_start(head)}) reported {result.rowcount} rows written: "
            f"the batch fails and nothing of it commits. {COUNT_HINT}")
    return result


#: A parameter followed by a cast, ``%(n)s::BIGINT`` (SQLAlchemy renders one for every psycopg 3 bind).
_CAST_PARAMETER = re.compile(r"(?<!%)(%\(\w+\)s)::")


def _cast_whole(template: str) -> str:
    """``(%(n)s)::BIGINT``: a cast binds tighter than a minus sign, so a quoted ``-9223372036854775808``
    followed by ``::BIGINT`` is read ``-(9223372036854775808::BIGINT)``, out of range, where the same
    value bound on the server (psycopg 3's plain path) is not. (psycopg2 always quotes on the
    client, its plain path included, so its templates are left as they are.)"""
    return _CAST_PARAMETER.sub(r"(\1)::", template)


#: What a count mismatch may mean, in every WriteCountError kstore raises.
COUNT_HINT = ("A table whose BEFORE INSERT trigger returns NULL, or with a rule on INSERT, drops rows on purpose: "
              "write it with defer_inserts = False (and without copy_rows).")
#: Statements per page of :func:`_run_pages`: one round trip each.
PAGE_SIZE = 500


def _run_pages(conn: Connection, plan: _Plan, rows: Sequence[dict[str, Any]]) -> CursorResult[Any]:
    """psycopg2: the statement once per row, quoted by the driver, in pages of :data:`PAGE_SIZE`
    statements sent as one text each, one per line (``;\n``, so no comment can run into the next
    statement, and the statement itself ends at its last token). Each page ends with a sentinel,
    ``SELECT <k>``, whose answer must come back: it proves the page's k statements all ran. Run one
    after another by the server, as one by one: an upsert's duplicate key is updated twice, as it
    would be, where one multi-row upsert would fail. Returns the last page's result (no row count)."""
    body, _, _, processors = plan
    if processors:
        rows = [_processed(row, processors) for row in rows]
    dbapi: Any = conn.connection.dbapi_connection
    result: CursorResult[Any] | None = None
    for at in range(0, len(rows), PAGE_SIZE):
        page = rows[at:at + PAGE_SIZE]
        with dbapi.cursor() as cur, _as_sqlalchemy_errors(conn, body):
            statements = ";\n".join(_quoted(conn, cur, body, page))
        result = conn.exec_driver_sql(f"{statements};\nSELECT {len(page)}",
                                      execution_options=_NO_PARAMETERS)
        ran = result.scalar() if result.returns_rows else None
        if ran != len(page):
            raise WriteCountError(
                f"a page of {len(page)} statements ({_start(body)}) did not end with its sentinel "
                f"(got {ran!r}): statements may have been lost; the batch fails and nothing of it commits.")
    assert result is not None  # rows is never empty
    return result


#: (driver, template) -> its RowFormat (None: a percent sign only the driver reads).
_FORMATS: dict[tuple[str, str], literals.RowFormat | None] = {}


def _quoted(conn: Connection, cur: Any, template: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each row's ``template`` with its values quoted, as the driver's ``mogrify`` quotes them
    (``cur``: psycopg2's cursor, psycopg 3's ``ClientCursor``).

    The common values' literals are written by :mod:`kstore.db.literals` (a third to a quarter of
    mogrify's CPU), on a connection that quotes as the driver's stock adapters do; a row with any
    other value goes through mogrify. The first row is also quoted by mogrify and compared: were
    they ever to differ, the whole batch goes through mogrify (and a warning says so), never a
    different text."""
    driver = conn.dialect.driver
    if driver == "psycopg":
        def mogrified(row: dict[str, Any]) -> str:
            return str(cur.mogrify(template, row))
    else:
        encoding = connection_encoding(conn)

        def mogrified(row: dict[str, Any]) -> str:
            return str(cur.mogrify(template, row).decode(encoding))

    key = (driver, template)
    form = _cached(_FORMATS, key, lambda: literals.RowFormat.of(template, driver))
    if form is None or not literals.stock_quoting(conn.connection.dbapi_connection, driver):
        return list(map(mogrified, rows))
    texts = list(map(form.row, rows))
    first = mogrified(rows[0])
    if texts[0] is not None and texts[0] != first:
        _log.warning("kstore's literal of a row differs from %s's (%s): the batch's rows are quoted "
                     "by %s instead; please report it", driver, _start(template), driver)
        _FORMATS[key] = None
        return list(map(mogrified, rows))
    texts[0] = first
    if None in texts:
        texts = [mogrified(row) if text is None else text for text, row in zip(texts, rows, strict=True)]
    return texts  # type: ignore[return-value]  # no None left


def _start(sql: str) -> str:
    words = " ".join(sql.split())
    return words if len(words) <= 60 else words[:57] + "..."


@contextmanager
def _as_sqlalchemy_errors(conn: Connection, sql: str) -> Iterator[None]:
    """A value the driver cannot quote fails as SQLAlchemy's error for it (``ProgrammingError``...),
    as it would if the statement had been executed with it."""
    dialect = conn.dialect
    try:
        yield
    except dialect.loaded_dbapi.Error as exc:
        raise DBAPIError.instance(sql, None, exc, dialect.loaded_dbapi.Error, dialect=dialect) from exc


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
    if is_upsert(statement):
        return _upsert_pages(statement, keys, conn)
    compiled: Any = statement.compile(dialect=conn.dialect, column_keys=list(keys), for_executemany=True)
    if not _binds_are(compiled, keys):
        return None
    sql: str = compiled.string
    many = compiled._insertmanyvalues
    if many is None:
        # psycopg 3's dialect compiles no insertmanyvalues for an INSERT without RETURNING (it
        # leaves executemany to the driver): a plain INSERT ends with its one-row VALUES.
        return _finish(compiled, _ending_row(sql))
    if many.is_default_expr or many.has_upsert_bound_parameters:
        return None
    row = f"({many.single_values_expr})"
    at = sql.find(row)
    if at < 0 or sql.find(row, at + 1) >= 0:
        return None
    return _finish(compiled, (sql[:at], row, sql[at + len(row):]))


def _upsert_pages(statement: Insert, keys: tuple[str, ...], conn: Connection) -> _Plan | None:
    """psycopg2: a Core upsert whose only parameters are the rows' goes as pages (see :func:`_run_pages`)."""
    if conn.dialect.driver != "psycopg2":
        return None  # psycopg 3's executemany: one (pipelined) statement per row
    # As for an executemany: no implicit RETURNING of the primary key.
    compiled: Any = statement.compile(dialect=conn.dialect, column_keys=list(keys), for_executemany=True)
    if not _binds_are(compiled, keys):
        return None
    return _finish(compiled, (compiled.string, "", ""), percent_ok=True)
