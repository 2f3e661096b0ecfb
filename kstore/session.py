"""The processor's session: SQLAlchemy's ``Session`` with INSERTs written behind.

A processor that writes one row per message calls ``session.execute(insert, row)``
once per message. Executed one by one, each INSERT is a database round trip plus
SQLAlchemy's per-statement work, and a ``handle()`` pipeline is several times
slower than the same rows written by ``handle_batch()``. So, like the ORM's unit
of work does for ``session.add()``, the session defers such INSERTs and sends
them together, as multi-row INSERTs, when anything else needs the database:

- Only a plain INSERT with one dict of parameters is deferred: no RETURNING or
  ``return_defaults()``, no multi-row ``values([...])``, not inside a savepoint.
  Everything else runs at once, after the INSERTs deferred before it.
- Order is kept: any other statement, ``flush()``, ``connection()``,
  ``begin_nested()`` and the end of the batch first send what was deferred,
  in the order it was executed; consecutive INSERTs of the same statement and
  the same parameter names become one ``executemany`` (SQLAlchemy turns that into
  multi-row ``INSERT ... VALUES``). Reading your own writes works.
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

``Processor.defer_inserts = False`` turns this off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, CursorResult, Insert
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.orm import Session
from sqlalchemy.sql.base import Executable


class _Deferred:
    """One deferred INSERT: its statement, its parameters and, once run alone, its result."""

    __slots__ = ("params", "result", "sent", "statement")

    def __init__(self, statement: Insert, params: dict[str, Any]) -> None:
        self.statement = statement
        self.params = params
        self.result: CursorResult[Any] | None = None
        self.sent = False


class DeferredResult:
    """What ``session.execute`` returns for a deferred INSERT.

    Reading any attribute runs the INSERT now, alone (after those deferred
    before it), and answers from its real ``CursorResult``.
    """

    __slots__ = ("_entry", "_session")

    def __init__(self, session: BatchSession, entry: _Deferred) -> None:
        self._session = session
        self._entry = entry

    def _result(self) -> CursorResult[Any]:
        return self._session._run_alone(self._entry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result(), name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._result())


def _deferrable(statement: Executable, params: Any) -> bool:
    return (
        type(params) is dict and bool(params) and isinstance(statement, Insert)
        and not statement._returning and not statement._return_defaults
        and not statement._multi_values and statement._select_names is None
    )


def _same_statement(a: Insert, b: Insert) -> bool:
    """True if ``a`` and ``b`` render the same SQL with the same embedded values.

    The cache key is SQLAlchemy's own test for "same SQL"; it leaves out the values
    of bound literals (``.values(x=1)``, ``on_conflict_do_update(set_=...)``), so
    those are compared too.
    """
    if a is b:
        return True
    ka, kb = a._generate_cache_key(), b._generate_cache_key()
    if ka is None or kb is None or ka != kb:
        return False
    return [p.effective_value for p in ka.bindparams] == [p.effective_value for p in kb.bindparams]


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
        self._deferred: list[_Deferred] = []

    def execute(self, statement: Any, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        core = (not args and not kwargs and isinstance(statement, Executable)
                and not statement._propagate_attrs and not self.dispatch.do_orm_execute)
        if core and self._defer_inserts and _deferrable(statement, params) and not self.in_nested_transaction():
            if not self._is_clean():
                self._autoflush()  # ORM changes made before this INSERT go first (unless no_autoflush)
            # A copy: code that reuses one dict for every row must not change rows already deferred.
            entry = _Deferred(statement, dict(params))
            self._deferred.append(entry)
            return DeferredResult(self, entry)
        if core:
            # Through the session's transaction: that sends the deferred INSERTs and
            # emits a pending SAVEPOINT (begin_nested() begins it lazily).
            conn = self._connection_for_bind(self._connection)
            self._autoflush()
            return conn.execute(statement, params)
        return super().execute(statement, params, *args, **kwargs)

    def send_deferred(self) -> None:
        """Send the deferred INSERTs now, in order; consecutive ones of the same statement together."""
        pending, self._deferred = self._deferred, []
        i = 0
        while i < len(pending):
            first = pending[i]
            j = i + 1
            while (j < len(pending) and pending[j].params.keys() == first.params.keys()
                   and _same_statement(pending[j].statement, first.statement)):
                j += 1
            if j - i == 1:
                first.result = self._connection.execute(first.statement, first.params)
            else:
                self._connection.execute(first.statement, [e.params for e in pending[i:j]])
            for entry in pending[i:j]:
                entry.sent = True
            i = j

    def _run_alone(self, entry: _Deferred) -> CursorResult[Any]:
        if not entry.sent:
            index = self._deferred.index(entry)
            self._deferred, after = self._deferred[:index], self._deferred[index + 1:]
            self.send_deferred()
            entry.result = self._connection.execute(entry.statement, entry.params)
            entry.sent = True
            self._deferred = after
        if entry.result is None:
            raise InvalidRequestError(
                "this INSERT was deferred and then sent together with others, so its own result is gone: "
                "read the result right after session.execute(), or use .returning(...)"
            )
        return entry.result

    # Every other way to the database sends the deferred INSERTs first: statements
    # through the session (execute, scalar(s), get, connection()), the ORM's flush,
    # its bulk operations, and savepoints (a rollback to one must not undo them).

    def _connection_for_bind(self, *args: Any, **kwargs: Any) -> Connection:
        self.send_deferred()
        return super()._connection_for_bind(*args, **kwargs)

    def flush(self, objects: Any = None) -> None:
        self.send_deferred()
        super().flush(objects)

    def _bulk_save_mappings(self, *args: Any, **kwargs: Any) -> None:
        self.send_deferred()
        super()._bulk_save_mappings(*args, **kwargs)

    def begin_nested(self) -> Any:
        self.send_deferred()
        return super().begin_nested()

    def rollback(self) -> None:
        self._deferred = []
        super().rollback()

    def close(self) -> None:
        self._deferred = []
        super().close()


@contextmanager
def batch_session(conn: Connection, *, defer_inserts: bool = True) -> Iterator[BatchSession]:
    """A :class:`BatchSession` inside ``conn``'s open transaction, flushed (deferred INSERTs
    sent) when the block ends normally, closed always.

    It joins the transaction as ``rollback_only``: a ``session.commit()`` in the block
    only flushes, so the caller commits the session's writes together with its own.
    """
    session = BatchSession(conn, defer_inserts=defer_inserts, join_transaction_mode="rollback_only")
    try:
        yield session
        session.flush()
    finally:
        session.close()
