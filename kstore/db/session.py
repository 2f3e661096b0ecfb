"""The processor's session: SQLAlchemy's ``Session`` with INSERTs written behind.

A processor that writes one row per message calls ``session.execute(insert, row)``
once per message. Executed one by one, each INSERT is a database round trip plus
SQLAlchemy's per-statement work, and a ``handle()`` pipeline is several times
slower than the same rows written by ``handle_batch()``. So, like the ORM's unit
of work does for ``session.add()``, the session defers such INSERTs and sends
them together, as multi-row INSERTs, when anything else needs the database:

- Only a plain INSERT with one dict of parameters is deferred: no RETURNING or
  ``return_defaults()``, no multi-row ``values([...])``, not inside a savepoint. A
  ``text()`` is deferred when its tokens (:mod:`kstore.db.sqltext`: comments, string
  literals, quoted identifiers and dollar quotes read as PostgreSQL reads them) make it
  exactly one INSERT with no RETURNING, followed by nothing but comments and one ``;``
  (``WITH ... INSERT`` runs at once: its CTEs may write).
  Everything else runs at once, after the INSERTs deferred before it.
- Order is kept: any other statement, ``flush()``, ``connection()``,
  ``begin_nested()`` and the end of the batch first send what was deferred,
  in the order it was executed; consecutive INSERTs of the same statement and
  the same parameter names are sent together: as one multi-row ``INSERT ... VALUES``
  on PostgreSQL (:mod:`kstore.db.manyrows`) when that means the same as one by one; an upsert
  (``ON CONFLICT``) or ``INSERT ... SELECT`` as one statement per row, in pages of 500 per
  round trip on psycopg2; else as SQLAlchemy's ``executemany``. Every rewritten write's
  row count is checked (:class:`~kstore.errors.WriteCountError` fails the batch); a table
  whose ``BEFORE INSERT`` trigger returns NULL, or with a rule, needs ``defer_inserts = False``.
  Reading your own writes works.
- The result: reading anything from it (``rowcount``, ``inserted_primary_key``)
  runs that INSERT at once, alone, and answers from its real result. Read it
  before the session's next statement: once sent with others, its own result
  is gone (a clear error says so).
- Errors: a failing INSERT raises when it is sent, not where it was executed.
  For kstore that is the same: the batch fails, is rolled back, and is retried
  one message per transaction, so the failure is pinned to its message. To catch
  an error in ``handle()`` itself, use a savepoint (``with session.begin_nested():``),
  inside which nothing is deferred; on PostgreSQL that was needed anyway, since a
  failed statement aborts the transaction.
  What sent the failing INSERT (a query, a savepoint, a flush, perhaps for a later
  message) raises :class:`DeferredInsertError`, not the INSERT's own error, so an
  ``except IntegrityError`` there cannot take it for its own. And the session is
  failed for good: every later use raises it again, and the batch ends with the
  INSERT's own error (see :func:`batch_session`), even if the processor caught it.

``Processor.defer_inserts = False`` turns this off.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from sqlalchemy import Connection, CursorResult, Insert, Table, event
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.orm import Session
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import TextClause

from .copy import copy_rows
from .manyrows import execute_many, execute_many_text, is_upsert
from .sqltext import is_one_insert, tokens

# SQLAlchemy's private names used here, for want of a public API (everything else is
# public; kstore.db.manyrows lists its own). tests/unit/db/test_session_sqlalchemy_names.py checks each by name
# and meaning, and the tests of tests/unit/db/test_session.py named below pin what kstore does
# with it, so an upgrade that changes one fails a test instead of silently deferring what must
# not be (they pass with SQLAlchemy 2.0.0, 2.0.58 and 2.1.9). Whether ORM changes wait to be
# flushed (once the private ``Session._is_clean()``) is asked from public parts: _orm_clean.
#
# - ``Insert._returning``, ``._return_defaults``, ``._multi_values`` (in _deferrable): whether
#   an INSERT returns rows or writes several; those run at once. SQLAlchemy offers setters
#   only; the public ``exported_columns`` would tell RETURNING but costs ~5 µs per statement
#   object (7 µs on 2.1), i.e. per message. Pinned by test_inserts_that_return_rows_or_write_several_run_at_once.
# - ``Executable._propagate_attrs`` (in BatchSession.execute): non-empty for a statement on
#   ORM entities, which must take the ORM's path; SQLAlchemy's own test. Pinned by
#   test_orm_statements_take_the_orms_path and the tests that Core INSERTs are deferred.
# - ``HasCacheKey._generate_cache_key()`` (in _same_statement): SQLAlchemy's "same SQL" test,
#   to send equal INSERTs as one executemany. Pinned by
#   test_consecutive_inserts_of_equal_statements_are_merged and
#   test_statements_with_different_embedded_values_are_not_merged.


class DeferredInsertError(Exception):
    """A deferred INSERT failed when the session sent it; ``__cause__`` is its own error.

    Raised by whatever needed the database and so sent it (a query, ``begin_nested()``, a
    flush), maybe for a later message: deliberately not a SQLAlchemy error, so that an
    ``except IntegrityError`` around a savepoint does not take it for the savepoint's. The
    session is failed for good: every later use raises this again, and :func:`batch_session`
    ends the batch with the INSERT's own error, so nothing of the batch can commit.
    """


class BatchRollbackError(Exception):
    """``session.rollback()`` was called inside a batch. It would undo the writes of the batch's
    other messages while kstore still commits their offsets, so it is refused: the batch fails
    (even if this error is caught), and the failing message is found, retried and dead-lettered
    or stops the worker as any failure. Undo part of a batch with a savepoint instead."""


class DeferredResult:
    """What ``session.execute`` returns for a deferred INSERT, and the session's record of it: its
    statement, its parameters and, once run alone, its result (or its error).

    Reading any attribute runs the INSERT now, alone (after those deferred
    before it), and answers from its real ``CursorResult``.
    """

    __slots__ = ("_params", "_result", "_sent", "_session", "_statement")

    def __init__(self, session: BatchSession, statement: Insert | TextClause, params: dict[str, Any]) -> None:
        self._session = session
        self._statement = statement
        self._params = params
        self._result: CursorResult[Any] | BaseException | None = None
        self._sent = False

    def _real(self) -> CursorResult[Any]:
        return self._session._run_alone(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._real())


def _deferrable(statement: Executable, params: Any) -> bool:
    return type(params) is dict and bool(params) and _deferrable_statement(statement)


def _deferrable_statement(statement: Executable) -> bool:
    """An INSERT that returns nothing and writes one row per set of parameters (judged per statement object)."""
    if isinstance(statement, Insert):
        return (not statement._returning and not statement._return_defaults
                and not statement._multi_values and statement.select is None)  # not from_select()
    return isinstance(statement, TextClause) and is_one_insert(statement.text)


def _execute_rows(conn: Connection, statement: Insert | TextClause, rows: list[Any]) -> CursorResult[Any]:
    """Many rows of an INSERT: one multi-row statement on PostgreSQL where it qualifies
    (kstore.db.manyrows, about half SQLAlchemy's CPU per row), else SQLAlchemy's executemany."""
    sent = (execute_many(conn, statement, rows) if isinstance(statement, Insert)
            else execute_many_text(conn, statement, rows))
    if sent is not None:
        return sent
    if isinstance(statement, Insert) and is_upsert(statement) and conn.dialect.driver == "psycopg2":
        # SQLAlchemy would send them as one multi-row upsert: one by one, as they were executed.
        for row in rows:
            result = conn.execute(statement, row)
        return result
    return conn.execute(statement, rows)


def _many_rows(statement: Executable) -> bool:
    """An executemany that kstore sends itself (as deferred rows are): a Core INSERT, or a ``text()``
    of one INSERT."""
    return isinstance(statement, Insert) or (isinstance(statement, TextClause) and is_one_insert(statement.text))


def _text_table(sql: str) -> str:
    """The table a ``text()`` INSERT writes, for an error message: the word after INTO."""
    words = [t.text for t in tokens(sql) or () if t.kind in ("word", "ident")]
    upper = [w.upper() for w in words]
    return words[upper.index("INTO") + 1] if "INTO" in upper[:-1] else "?"


def _same_statement(a: Insert | TextClause, b: Insert | TextClause) -> bool:
    """True if ``a`` and ``b`` render the same SQL with the same embedded values.

    The cache key is SQLAlchemy's own test for "same SQL"; it leaves out the values
    of bound literals (``.values(x=1)``, ``on_conflict_do_update(set_=...)``), so
    those are compared too.
    """
    if a is b:
        return True
    ka, kb = a._generate_cache_key(), b._generate_cache_key()
    # ``==``, not ``!=``: early 2.0 CacheKeys have no ``!=`` of their own (a tuple's compares the binds too).
    return (ka is not None and kb is not None and ka == kb
            and [p.effective_value for p in ka.bindparams] == [p.effective_value for p in kb.bindparams])


class BatchSession(Session):
    """The session of one batch, bound to the worker's connection inside its transaction.

    Core statements also skip the ORM's general execute path (autoflush, then
    execute on the connection), which costs about as much as a round trip;
    ORM statements, options and event hooks take the ORM's path.
    """

    def __init__(self, bind: Connection, *, defer_inserts: bool = True, **kwargs: Any) -> None:
        super().__init__(bind=bind, **kwargs)
        self._connection = bind
        self._defer_inserts = defer_inserts
        self._deferred: list[DeferredResult] = []
        #: The last statement object taken for a deferrable INSERT (see execute()).
        self._last_insert: Executable | None = None
        #: True inside flush(): a deferred INSERT then does not flush (as SQLAlchemy's autoflush).
        self._in_flush = False
        #: The error of a deferred INSERT that failed when sent: the session is failed for good.
        self._failure: BaseException | None = None
        self._failure_message = ""
        #: Set when an object is first attached (added, merged, deleted): see :meth:`_orm_clean`.
        self._orm_attached = False
        #: Counts every call that may read or write through the session (statements, the
        #: connection, flushes, savepoints): unchanged across a handle() call, plus no pending
        #: ORM change, means that call did nothing in the transaction (see :meth:`untouched`).
        self.touches = 0

    def _orm_clean(self) -> bool:
        """No ORM change waits to be flushed (new, changed or deleted objects): what SQLAlchemy's
        private ``Session._is_clean()`` tells, from public parts. Asked per deferred INSERT, so
        the usual case, a session no ORM object ever came near, is answered without building
        the ``new`` and ``deleted`` sets (about 0.6 µs per message)."""
        if not self._orm_attached and not len(self.identity_map):
            return True
        return not (self.identity_map.check_modified() or self.new or self.deleted)

    def untouched(self, mark: int) -> bool:
        """Nothing went through the session since ``touches`` was ``mark``, and no ORM change waits."""
        return self.touches == mark and self._orm_clean()

    def execute(self, statement: Any, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.touches += 1
        if args or kwargs:
            core = insert = False
        elif statement is self._last_insert:
            core = insert = True  # the statement object judged below for an earlier message
        else:
            # A statement's judgement is its own: SQLAlchemy statements are immutable (``.values()``,
            # ``.returning()``... make new ones), so it is made once per statement object.
            core = isinstance(statement, Executable) and not statement._propagate_attrs
            insert = core and _deferrable_statement(statement)
            if insert:
                self._last_insert = statement
        core = core and not self.dispatch.do_orm_execute
        if (core and insert and type(params) is dict and params and self._defer_inserts
                and not self.in_nested_transaction()):
            if not self._orm_clean():
                self._flush_first()  # ORM changes made before this INSERT go first (unless no_autoflush)
            # A copy: code that reuses one dict for every row must not change rows already deferred.
            entry = DeferredResult(self, statement, dict(params))
            self._deferred.append(entry)
            return entry
        if core:
            # Through the session's transaction: that sends the deferred INSERTs (see
            # connection()) and emits a pending SAVEPOINT (begin_nested() begins it lazily).
            conn = self.connection()
            if not self._orm_clean():
                self._flush_first()
            if type(params) is list and params and _many_rows(statement):
                return _execute_rows(conn, statement, params)
            return conn.execute(statement, params)
        self.send_deferred()
        return super().execute(statement, params, *args, **kwargs)

    def _flush_first(self) -> None:
        if self.autoflush and not self._in_flush:
            self.flush()

    def send_deferred(self) -> None:
        """Send the deferred INSERTs now, in order; consecutive ones of the same statement together.

        If sending fails, the session is failed for good: this raises
        :class:`DeferredInsertError` now and at every later use (see there).
        """
        if self._failure is not None:
            self._raise_failure()
        pending = self._deferred
        if not pending:
            return
        self._deferred = []
        execute = self._connection.execute
        i, n = 0, len(pending)
        while i < n:
            first = pending[i]
            statement, keys = first._statement, first._params.keys()
            j = i + 1
            while j < n:
                entry = pending[j]
                if entry._params.keys() != keys or not (entry._statement is statement
                                                         or _same_statement(entry._statement, statement)):
                    break
                j += 1
            try:
                if j - i == 1:
                    first._result = execute(statement, first._params)
                else:
                    _execute_rows(self._connection, statement, [e._params for e in pending[i:j]])
            except BaseException as exc:
                self._deferred = pending[i:]  # kept, never sent: the session is failed
                self._fail(exc, statement, j - i)
            for entry in pending[i:j]:
                entry._sent = True
            i = j

    def _fail(self, exc: BaseException, statement: Insert | TextClause, rows: int) -> NoReturn:
        """Fail the session for good with ``exc``, the error of sending deferred INSERTs."""
        self._failure = exc
        # Nothing is deferred any more: execute() then takes a path that raises the failure.
        self._defer_inserts = False
        if isinstance(statement, TextClause):
            table = _text_table(statement.text)
        else:
            table = str(getattr(statement.table, "name", statement.table))
        together = f" (one of {rows} rows sent together)" if rows > 1 else ""
        self._failure_message = (
            f"a deferred INSERT into {table}{together} failed when the session sent it: "
            f"{type(exc).__name__}: {exc}\n"
            "It was executed earlier in this batch, maybe for another message: this error is not "
            "that of what sent it. The session can no longer be used and the batch fails."
        )
        if not isinstance(exc, Exception):
            raise exc
        self._raise_failure()

    def _raise_failure(self) -> NoReturn:
        raise DeferredInsertError(self._failure_message) from self._failure

    def _run_alone(self, entry: DeferredResult) -> CursorResult[Any]:
        if not entry._sent:
            if self._failure is not None:
                self._raise_failure()
            deferred = self._deferred
            try:
                index = deferred.index(entry)
            except ValueError:
                raise InvalidRequestError(
                    "this INSERT was never sent: the session was rolled back or closed first") from None
            self._deferred = deferred[:index]
            try:
                self.send_deferred()
            except BaseException:
                self._deferred += deferred[index:]  # kept, never sent: the session is failed
                raise
            # Now alone, as if it had not been deferred: its own error raises here, as it is.
            entry._sent = True
            self._deferred = deferred[index + 1:]
            try:
                entry._result = self._connection.execute(entry._statement, entry._params)
            except BaseException as exc:
                entry._result = exc
                raise
        result = entry._result
        if isinstance(result, BaseException):
            raise InvalidRequestError("this INSERT failed when its result was first read") from result
        if result is None:
            raise InvalidRequestError(
                "this INSERT was deferred and then sent together with others, so its own result is gone: "
                "read the result right after session.execute(), or use .returning(...)"
            )
        return result

    # Every other way to the database sends the deferred INSERTs first: statements
    # through the session (execute() above, scalar(s), and get(), refresh(), queries and
    # lazy loads, which call execute()), connection(), the ORM's flush, its bulk
    # operations, and savepoints (a rollback to one must not undo them).

    def copy_rows(
        self, table: Table | str, rows: Sequence[Mapping[str, Any] | Sequence[Any]],
        columns: Sequence[str] | None = None, *, schema: str | None = None,
    ) -> int:
        """Write ``rows`` into ``table`` with PostgreSQL's ``COPY ... FROM STDIN``, in the batch's
        transaction (so exactly once, like every write through the session); returns how many.

        ``rows`` are dicts (the columns are the first one's keys, or ``columns``) or tuples (in
        the order of ``columns``, or of the :class:`~sqlalchemy.Table`'s columns). COPY is
        PostgreSQL's fastest way in, several times an INSERT per row; on SQLite the same rows
        go in as one multi-row INSERT. What was deferred before is sent first. Values: what
        psycopg adapts (psycopg 3), or None, bool, int, float, Decimal, str, bytes, date,
        time, datetime, timedelta and UUID (psycopg2); dicts and lists are written as JSON.
        The table's own column types (a ``TypeDecorator``) are applied; its Python-side
        defaults are not: give every value. A failure fails the batch like any other write.
        """
        conn = self.connection()
        if not self._orm_clean():
            self._flush_first()
        return copy_rows(conn, table, rows, columns, schema=schema)

    def connection(self, *args: Any, **kwargs: Any) -> Connection:
        self.touches += 1
        self.send_deferred()
        return super().connection(*args, **kwargs)

    def scalar(self, *args: Any, **kwargs: Any) -> Any:
        self.touches += 1
        self.send_deferred()
        return super().scalar(*args, **kwargs)

    def scalars(self, *args: Any, **kwargs: Any) -> Any:
        self.touches += 1
        self.send_deferred()
        return super().scalars(*args, **kwargs)

    def flush(self, objects: Any = None) -> None:
        self.touches += 1
        self.send_deferred()
        in_flush, self._in_flush = self._in_flush, True
        try:
            super().flush(objects)
        finally:
            self._in_flush = in_flush

    def bulk_save_objects(self, *args: Any, **kwargs: Any) -> None:
        self.touches += 1
        self.send_deferred()
        super().bulk_save_objects(*args, **kwargs)

    def bulk_insert_mappings(self, *args: Any, **kwargs: Any) -> None:
        self.touches += 1
        self.send_deferred()
        super().bulk_insert_mappings(*args, **kwargs)

    def bulk_update_mappings(self, *args: Any, **kwargs: Any) -> None:
        self.touches += 1
        self.send_deferred()
        super().bulk_update_mappings(*args, **kwargs)

    def begin_nested(self) -> Any:
        # Before the SAVEPOINT: a rollback to it must not undo them, and their failure is
        # a DeferredInsertError, which the processor's ``except`` around the savepoint
        # does not take for the savepoint's own.
        self.touches += 1
        self.send_deferred()
        return super().begin_nested()

    def rollback(self) -> None:
        error = BatchRollbackError(
            "session.rollback() inside a batch would undo the writes of the batch's other messages: refused, "
            "and the batch fails; to undo part of a batch use a savepoint: with self.session.begin_nested(): ...")
        if self._failure is None:  # failed for good, even if the processor catches this
            self._failure, self._failure_message, self._defer_inserts = error, str(error), False
        raise error

    def close(self) -> None:
        """A processor's own ``close()`` (or ``with self.session as s:``) sends what is deferred
        first: its writes belong to the batch. (The batch's end closes it through :meth:`_end`.)"""
        self.send_deferred()
        super().close()

    def _end(self) -> None:
        """Closed by kstore when the batch ends: anything still deferred was never meant to be sent
        (the batch failed before its flush)."""
        self._deferred = []
        super().close()


@event.listens_for(BatchSession, "before_attach")
def _attached(session: Session, _instance: object) -> None:
    # Every object that becomes pending or is merged passes here first (a loaded one is in the
    # identity map): until then the session has no ORM change to flush.
    if isinstance(session, BatchSession):
        session._orm_attached = True


@contextmanager
def batch_session(conn: Connection, *, defer_inserts: bool = True) -> Iterator[BatchSession]:
    """A :class:`BatchSession` inside ``conn``'s open transaction, flushed (deferred INSERTs
    sent) when the block ends normally, closed always.

    It joins the transaction as ``rollback_only``: a ``session.commit()`` in the block
    only flushes, so the caller commits the session's writes together with its own.

    If a deferred INSERT failed when it was sent, the block raises that INSERT's own error
    (IntegrityError, OperationalError...), whatever the code in it did with the
    :class:`DeferredInsertError` (let it through, caught it, raised another): the caller
    must not commit, and kstore's worker judges the original error (a constraint fails the
    batch, whose message is then found; a lost connection is retried as it is).
    """
    session = BatchSession(conn, defer_inserts=defer_inserts, join_transaction_mode="rollback_only")
    try:
        yield session
        session.flush()
    except Exception:
        failure = session._failure
        if failure is None:
            raise
        raise failure  # noqa: B904 - chained to what the block raised, for its traceback
    finally:
        session._end()
