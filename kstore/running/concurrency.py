"""Concurrency inside a batch: the messages of one batch run as asyncio tasks, at most
``max_concurrency`` at a time and one key after another, and the batch still commits once.

- :func:`lanes` says which messages must run one after another (``ordering``).
- :func:`run_lanes` is the scheduler: it starts each lane's messages in offset order, never
  more than ``limit`` at a time, and on the first failure cancels the others and raises.
- :class:`AsyncSession` is what ``self.session`` is for an ``async def`` handler: the batch's one
  session, with its statements serialized (see there for why on the loop's own thread).
- :func:`run_on_loop` runs a coroutine on the processor's own event loop (an async processor's
  batch: :mod:`kstore.running.handler`).

The batch's transaction and its commit stay where they are (:mod:`kstore.engine.commit`): nothing
here commits; a batch whose tasks did not all finish raises, and is rolled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import math
import selectors
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kstore.errors import KstoreError, ProcessorContractError
from kstore.types import Ordering

if TYPE_CHECKING:
    from kstore.db.session import BatchSession

_T = TypeVar("_T")

#: The index (in its batch) of the message the current task handles; None outside one.
_slot: contextvars.ContextVar[int | None] = contextvars.ContextVar("kstore_message_slot", default=None)

#: How long cancelled tasks get to unwind (their ``finally`` blocks) before the batch gives up on them.
CANCEL_GRACE_S = 5.0


def lanes(msgs: Sequence[Any], ordering: Ordering) -> list[Hashable]:
    """Per message, its lane: messages of one lane run one after another, in offset order.

    ``"key"``: one lane per (topic, partition, key); messages without a key share their
    partition's keyless lane. ``"partition"``: one lane per partition. ``"none"``: one per
    message. A key that is not hashable (a JSON object) is compared by its JSON text.
    """
    if ordering == "none":
        return list(range(len(msgs)))
    if ordering == "partition":
        return [(m.topic, m.partition) for m in msgs]
    out: list[Hashable] = []
    for m in msgs:
        key = m.key
        try:
            hash(key)
        except TypeError:
            key = ("json", json.dumps(key, sort_keys=True, default=str))
        out.append((m.topic, m.partition, key is None, key))
    return out


class HandlerCancelled(Exception):
    """A message's handler ended cancelled, though the batch did not cancel it."""


class BatchTimeout(Exception):
    """The batch's messages did not all finish within the batch's deadline: they were cancelled."""


async def run_lanes(lane_of: Sequence[Hashable], work: Callable[[int], Coroutine[Any, Any, None]], limit: int,
                    timeout: float | None = None) -> None:
    """Run ``work(i)`` for every index of ``lane_of``, each in its own task: one lane's indexes one
    after another in order, different lanes side by side, never more than ``limit`` at a time.

    Returns when all have finished. The first that raises (or the ``timeout``, or the caller's
    own cancellation) cancels every task still running, waits for them to unwind, and raises.
    Tasks start in the order their lane became free (at first: index order), so a message never
    waits behind a later one of another lane.
    """
    if limit < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {limit}")
    if not lane_of:
        return
    lanes_ = _Lanes(lane_of, work, limit)
    lanes_.fill()
    try:
        if timeout is None:
            await lanes_.finished
        else:
            try:
                await asyncio.wait_for(asyncio.shield(lanes_.finished), timeout)
            except asyncio.TimeoutError:
                raise BatchTimeout(
                    f"{len(lanes_.running)} message(s) of the batch were still running after {timeout:g}s "
                    "(liveness_timeout_s): cancelled, and the batch failed") from None
    finally:
        if not lanes_.finished.done():
            lanes_.finished.cancel()
        await _cancel(list(lanes_.running))


class _Lanes:
    """The state of :func:`run_lanes`: driven by the tasks' done callbacks, so starting the next
    message costs O(1), whatever the number of tasks running."""

    def __init__(self, lane_of: Sequence[Hashable], work: Callable[[int], Coroutine[Any, Any, None]],
                 limit: int) -> None:
        self.lane_of, self.work, self.limit = lane_of, work, limit
        self.loop = asyncio.get_running_loop()
        #: Per busy lane, its indexes not started yet; the lanes that are free, by their next index.
        self.waiting: dict[Hashable, deque[int]] = {}
        self.ready: deque[int] = deque()
        for i, lane in enumerate(lane_of):
            queue = self.waiting.get(lane)
            if queue is None:
                self.waiting[lane] = deque()
                self.ready.append(i)
            else:
                queue.append(i)
        self.running: dict[asyncio.Task[None], int] = {}
        self.remaining = len(lane_of)
        self.finished: asyncio.Future[None] = self.loop.create_future()

    def fill(self) -> None:
        ready, running = self.ready, self.running
        while ready and len(running) < self.limit:
            index = ready.popleft()
            task = self.loop.create_task(self.work(index))
            running[task] = index
            task.add_done_callback(self.done)

    def done(self, task: asyncio.Task[None]) -> None:
        index = self.running.pop(task)
        error = None if task.cancelled() else task.exception()  # retrieved always: no "never retrieved" log
        finished = self.finished
        if finished.done():
            return
        if task.cancelled():
            # Not by us (we cancel only once `finished` is done): the handler's own doing. A failure of
            # the message, not a stop of the worker (CancelledError is a BaseException).
            finished.set_exception(HandlerCancelled(f"the handler of message {index} of the batch was cancelled"))
            return
        if error is not None:
            finished.set_exception(error)
            return
        self.remaining -= 1
        lane = self.lane_of[index]
        queue = self.waiting[lane]
        if queue:
            self.ready.append(queue.popleft())
        else:
            del self.waiting[lane]
        self.fill()
        if not self.remaining:
            finished.set_result(None)


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and let them unwind (for at most CANCEL_GRACE_S)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)


class _TaskLock:
    """A lock held by one task at a time, re-entered freely by that task (a statement inside its
    own savepoint); tasks waiting for it get it in the order they asked."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None
        self._depth = 0

    def held_by_another(self) -> bool:
        return self._owner is not None and self._owner is not asyncio.current_task()

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if self._owner is task and task is not None:
            self._depth += 1
            return
        await self._lock.acquire()
        self._owner, self._depth = task, 1

    async def __aexit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
            self._lock.release()


class _Statement:
    """What :meth:`AsyncSession.execute` (and the like) return: the call runs when awaited.

    One that is never awaited never runs: :meth:`AsyncSession.check_awaited` refuses the message.
    """

    __slots__ = ("_args", "_call", "_session", "_slot", "_what", "awaited")

    def __init__(self, session: AsyncSession, what: str, call: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._session, self._what, self._call, self._args = session, what, call, args
        self._slot = _slot.get()
        self.awaited = False
        session._pending.append(self)

    def __await__(self) -> Any:
        self.awaited = True
        return self._session._run(self._what, self._call, self._args).__await__()


class AsyncSession:
    """``self.session`` in an ``async def`` handler: the batch's one session (its one transaction),
    shared by the batch's concurrent handlers.

    Every call that reaches the database is awaited and runs under one lock, so statements of
    concurrent handlers never interleave, and a savepoint (``async with session.begin_nested()``)
    holds the lock for its whole block: no other handler's statement lands inside it.

    The statement itself runs on the event loop's thread (the batch's thread), blocking the loop
    for its round trip: the batch has one connection, so statements are serial anyway, and on the
    batch's thread the transaction keeps everything that makes it safe (the psycopg2 connection
    never changes threads, the stop signal's timeout and the statement deadline still reach it).
    A deferred INSERT does not touch the database at all, so the common ``execute(insert, row)``
    costs no wait. Anything else of the sync session: ``await session.run_sync(fn)``.
    """

    def __init__(self, session: BatchSession) -> None:
        self.sync_session = session
        self._lock = _TaskLock()
        self._pending: list[_Statement] = []
        #: The message slots that used the session (a rejected message must have touched nothing).
        self.touched: set[int | None] = set()
        #: How many calls ran on the session (the batch's statements, in the database's order), and
        #: per message slot, that count when its last call ran (or when it started): see :meth:`position`.
        self._calls = 0
        self._last: dict[int, int] = {}

    async def _run(self, what: str, call: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        async with self._lock:
            self._ran(_slot.get())
            return call(*args)

    def _ran(self, slot: int | None) -> None:
        self.touched.add(slot)
        self._calls += 1
        if slot is not None:
            self._last[slot] = self._calls

    def started(self, slot: int) -> None:
        """The message in ``slot`` starts now: what it produces before its first call follows every call so far."""
        self._last[slot] = self._calls

    def position(self, slot: int | None) -> int:
        """Where, among the batch's calls on the session, a record produced now by the message in ``slot``
        belongs: right after that message's last call (it carries what the database told the message,
        whatever the other messages did since). Outside a message (a custom ``handle_batch``): now."""
        return self._calls if slot is None else self._last.get(slot, 0)

    def _statement(self, what: str, call: Callable[..., Any], *args: Any) -> _Statement:
        return _Statement(self, what, call, args)

    def execute(self, statement: Any, params: Any = None, **kwargs: Any) -> Awaitable[Any]:
        """``await session.execute(statement, params)``: as the sync session's (deferred INSERTs too)."""
        return self._statement("execute", lambda: self.sync_session.execute(statement, params, **kwargs))

    def scalar(self, statement: Any, params: Any = None, **kwargs: Any) -> Awaitable[Any]:
        return self._statement("scalar", lambda: self.sync_session.scalar(statement, params, **kwargs))

    def scalars(self, statement: Any, params: Any = None, **kwargs: Any) -> Awaitable[Any]:
        return self._statement("scalars", lambda: self.sync_session.scalars(statement, params, **kwargs))

    def get(self, entity: Any, ident: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._statement("get", lambda: self.sync_session.get(entity, ident, **kwargs))

    def flush(self) -> Awaitable[None]:
        return self._statement("flush", self.sync_session.flush)

    def copy_rows(self, table: Any, rows: Any, columns: Any = None, **kwargs: Any) -> Awaitable[int]:
        """``await session.copy_rows(...)``: see :meth:`kstore.db.session.BatchSession.copy_rows`."""
        return self._statement("copy_rows", lambda: self.sync_session.copy_rows(table, rows, columns, **kwargs))

    def run_sync(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> Awaitable[_T]:
        """``await session.run_sync(fn, ...)``: ``fn(sync_session, ...)`` under the session's lock
        (the ORM's ``add``, ``merge``, ``delete``, and anything else of the sync session)."""
        return self._statement("run_sync", lambda: fn(self.sync_session, *args, **kwargs))

    @contextlib.asynccontextmanager
    async def begin_nested(self) -> AsyncIterator[None]:
        """``async with session.begin_nested():`` a savepoint, rolled back if the block raises.
        Other handlers' statements wait until the block ends."""
        async with self._lock:
            self._ran(_slot.get())
            with self.sync_session.begin_nested():
                yield

    def check_awaited(self, slot: int | None, owner: str) -> None:
        """Refuse the message in ``slot`` if it called a method of the session without awaiting it:
        that call never ran, and its batch must not commit as if it had."""
        pending, self._pending = self._pending, []
        lost = [s for s in pending if not s.awaited and s._slot == slot]
        self._pending = [s for s in pending if not s.awaited and s._slot != slot]
        if lost:
            raise ProcessorContractError(
                f"{owner} called self.session.{lost[0]._what}(...) without `await` in an async handler, so it "
                f"never ran; nothing of the batch was committed: write `await self.session.{lost[0]._what}(...)`")

    def __getattr__(self, name: str) -> Any:
        raise KstoreError(
            f"self.session.{name} is not available in an async handler: use `await self.session.run_sync("
            f"lambda session: session.{name}(...))`; statements: `await self.session.execute(...)`")


def current_slot() -> int | None:
    """The index in its batch of the message the current task handles (None outside one)."""
    return _slot.get()


def set_slot(index: int) -> None:
    _slot.set(index)


class _FineTimers(selectors.DefaultSelector):
    """The loop's selector, with timers to a tenth of a millisecond instead of one.

    epoll takes its timeout in whole milliseconds, rounded up, so every ``await asyncio.sleep(t)``
    (and every timeout) on a stock loop overshoots by half a millisecond on average, 0.75 ms
    measured: a handler that awaits a 2.5 ms call takes 3.25 ms, 30% more. Here epoll waits the
    whole milliseconds and ``time.sleep`` the rest (a precise nanosleep), with no busy polling.
    The cost: a socket that becomes readable during that last fraction of a millisecond is
    seen at its end, less than 1 ms late.
    """

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0:
            return super().select(timeout)
        start = time.monotonic()
        whole = math.floor(timeout * 1000) / 1000
        if whole > 0:
            ready = super().select(whole)
            if ready:
                return ready
        left = timeout - (time.monotonic() - start)
        if left > 0:
            time.sleep(left)
        return super().select(0)


_loops: weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()


def loop_of(owner: Any) -> asyncio.AbstractEventLoop:
    """The event loop ``owner`` (a processor) runs on, made once and kept for its life: clients a
    processor makes (an ``httpx.AsyncClient``) stay bound to the loop they were first used on."""
    loop = _loops.get(owner)
    if loop is None or loop.is_closed():
        loop = _loops[owner] = asyncio.SelectorEventLoop(_FineTimers())
        weakref.finalize(owner, loop.close)
    return loop


def close_loop(owner: Any) -> None:
    loop = _loops.pop(owner, None)
    if loop is not None and not loop.is_closed():
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def run_on_loop(owner: Any, coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to its end on ``owner``'s loop, from the batch's thread.

    If it is interrupted from outside (a stop signal's timeout raised while the loop waits),
    its task is cancelled and unwound before the interruption goes on: no task of a batch
    that rolled back keeps running into the next one.
    """
    loop = loop_of(owner)
    task = loop.create_task(coro)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(asyncio.wait([task], timeout=CANCEL_GRACE_S))
        raise


def is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn)
