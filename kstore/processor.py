"""What users touch: the :class:`Processor` base class and :class:`Message`; and how kstore calls a
processor (:func:`run_handler`, the checks of what its hooks return) and finds one by name
(:func:`load_processor`), the same for a worker, a dead letter's replay and :mod:`kstore.testing`."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import operator
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol, cast

from sqlalchemy import Connection

if TYPE_CHECKING:
    from sqlalchemy import Engine

from kstore.concurrency import (
    ORDERINGS,
    AsyncSession,
    Ordering,
    current_slot,
    is_async,
    lanes,
    run_lanes,
    run_on_loop,
    set_slot,
)
from kstore.db.session import BatchSession, batch_session
from kstore.db.setuplock import setup_lock
from kstore.db.sqlerrors import first_line
from kstore.errors import (
    ConfigurationError,
    KstoreError,
    MissingTopicError,
    ProcessorContractError,
    ProcessorError,
    UndeclaredTopicError,
)
from kstore.partition import TopicPartition as TopicPartition  # re-exported: handlers' hooks name it
from kstore.records import Message as Message  # re-exported: users import it from here
from kstore.records import Produced
from kstore.retry import Reject, Retry, RetryPolicy

Format = Literal["bytes", "str", "json"]
OnError = Literal["stop", "dead_letter"]


def to_ms(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


def decode(data: bytes | None, fmt: Format) -> Any:
    """Turn raw bytes into the value a processor asked for with ``key_format``/``value_format``."""
    if data is None or fmt == "bytes":
        return data
    if fmt == "str":
        return data.decode("utf-8")
    return json.loads(data)


class ProduceError(Reject):
    """A record given to :meth:`Processor.produce` can never be published (a value that cannot be
    serialized, a partition its topic does not have, a record over the size limit). A topic the
    cluster does not have is not one of these: that is an outage (:class:`~kstore.MissingTopicError`).

    A :class:`~kstore.retry.Reject`: the message that produced it is not retried but, by
    ``on_error``, dead-lettered at once (nothing it produced is published) or stops the worker.
    """


class DeserializationError(Reject):
    """A record's key or value could not be deserialized (:meth:`Processor.deserialize` raised, e.g. a
    value that is not JSON with ``value_format = "json"``); the original error is its cause.

    A :class:`~kstore.retry.Reject`, attributed to that one message without running its batch:
    by ``on_error``, it is dead-lettered at once, in the transaction of the rest of its batch, or
    the worker stops with the offset just before it. (A custom ``deserialize`` that raises
    :class:`~kstore.retry.Retry` fails its batch instead, which is retried as any failing batch.)
    """

    @classmethod
    def of(cls, exc: Exception) -> DeserializationError:
        error = cls(f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error


def deserialized(processor: Processor, topic: str, partition: int, offset: int, key: bytes | None,
                 value: bytes | None, headers: Sequence[tuple[str, bytes | None]], timestamp_ms: int | None,
                 ) -> Message:
    """The message as :meth:`Processor.handle` receives it; :class:`DeserializationError` if its key or
    value cannot be deserialized (a :class:`~kstore.retry.Retry` raised by ``deserialize`` passes)."""
    try:
        k, v = processor.deserialize(key, value)
    except Retry:
        raise
    except Exception as exc:
        raise DeserializationError.of(exc) from exc
    return Message(topic, partition, offset, k, v, headers, timestamp_ms)


def encode(data: Any, what: str) -> bytes | None:
    """A key or value as Kafka bytes: bytes as they are, ``str`` as UTF-8, None as none (a
    tombstone, for a value), anything else as JSON (compact)."""
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        return data.encode("utf-8")
    try:
        return json.dumps(data, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ProduceError(f"cannot serialize the {what} ({type(data).__name__}) as JSON: {exc}") from None


def _headers(headers: Any) -> tuple[tuple[str, bytes | None], ...]:
    if not headers:
        return ()
    pairs = headers.items() if isinstance(headers, dict) else headers
    out = []
    for name, value in pairs:
        if not isinstance(name, str):
            raise ProduceError(f"a header's name must be a str, got {type(name).__name__}")
        out.append((name, None if value is None else encode(value if isinstance(value, (bytes, str)) else str(value),
                                                               f"header {name!r}")))
    return tuple(out)


#: What :meth:`Processor.produce` raises that is neither a message's fault nor to be caught by the
#: processor: a topic missing from ``produces`` (a programming error) or from the cluster (an outage).
NOT_THE_MESSAGE = (ProcessorContractError, MissingTopicError)


def declared_topics(processor: Processor) -> frozenset[str] | None:
    """The topics the processor declares it produces to (``produces``), or None if it declares none."""
    produces = processor.produces
    if produces is None:
        return None
    if isinstance(produces, str) or not all(isinstance(t, str) and t for t in produces):
        raise ConfigurationError(f"{type(processor).__name__}.produces must be a list of topic names, "
                                 f"got {produces!r}")
    return frozenset(produces)


def produce_check(partitions: Callable[[str], int | None] | None, max_bytes: int,
                  where: str = "Kafka", produces: frozenset[str] | None = None) -> Callable[[Produced], None]:
    """What :meth:`Processor.produce` checks a record against before it goes to the outbox, the same
    for a worker, a dead letter's replay and :func:`kstore.testing.run_batch`.

    - ``produces`` (the processor's declared topics, if any): another topic raises
      :class:`~kstore.UndeclaredTopicError`, which stops the worker.
    - its size against ``max_bytes``, and (given ``partitions``, a topic's partition count, 0 for
      none, None when the brokers did not answer) its partition: a record that could never be
      published is the message's failure here (:class:`ProduceError`), not later in the relay,
      where it would stop a shard until it can be.
    - a topic the cluster does not have raises :class:`~kstore.MissingTopicError`: an outage,
      waited out, never the message's failure.
    """

    def check(record: Produced) -> None:
        if produces is not None and record.topic not in produces:
            raise UndeclaredTopicError(f"produce() to topic {record.topic!r}, which is not in produces "
                                       f"({', '.join(sorted(produces)) or 'none'}): add it, or fix the name")
        size = record.size()
        if size > max_bytes:
            raise ProduceError(f"a record for topic {record.topic!r} is {size:,} bytes, over "
                               f"outbox_max_record_bytes={max_bytes:,}")
        count = partitions(record.topic) if partitions is not None else None
        if count is None:
            return  # not known now: the relay finds out when it publishes, and never skips the record
        if count == 0:
            raise MissingTopicError(f"output topic {record.topic!r} does not exist in {where}: create it "
                                    f"(kstore topics create)")
        if record.partition is not None and record.partition >= count:
            raise ProduceError(f"topic {record.topic!r} has {count} partition(s); there is no partition "
                               f"{record.partition}")

    return check


class Outgoing:
    """The records a batch produced (:meth:`Processor.produce`), written to the outbox with its
    commit. ``check`` (see :func:`produce_check`) refuses a record that could never be published,
    at once; what it raised that is not the message's fault (:data:`NOT_THE_MESSAGE`) is kept in
    ``refused``, so the batch fails even if the processor caught it."""

    def __init__(self, check: Callable[[Produced], None] | None = None) -> None:
        self.records: list[Produced] = []
        self._check = check
        self.refused: Exception | None = None

    def add(self, topic: str, value: Any, key: Any, headers: Any, partition: int | None) -> None:
        self.records.append(self.make(topic, value, key, headers, partition))

    def make(self, topic: str, value: Any, key: Any, headers: Any, partition: int | None) -> Produced:
        """The record, serialized and checked (:class:`ProduceError` if it could never be published)."""
        if not isinstance(topic, str) or not topic:
            raise ProduceError(f"produce() needs a topic name, got {topic!r}")
        if partition is not None and (not isinstance(partition, int) or partition < 0):
            raise ProduceError(f"produce(): partition must be a non-negative int, got {partition!r}")
        record = Produced(topic, encode(value, "value"), encode(key, "key"), _headers(headers), partition)
        if self._check is not None:
            try:
                self._check(record)
            except NOT_THE_MESSAGE as exc:
                self.refused = self.refused or exc
                raise
        return record


class _InWriteOrder:
    """What :meth:`Processor.produce` adds to in a batch of concurrent handlers.

    Each record is placed right after the last statement its message ran on the batch's session
    (:meth:`AsyncSession.position`), records of one place in the order produced: the order of the
    database's statements, the one a record carrying what a statement returned (the stock left
    after an ``UPDATE ... RETURNING``) must be read in, even if its handler awaited something else
    before producing it. Input offset order would not be: concurrent handlers' statements
    interleave. A rejected message's records are left out.
    """

    def __init__(self, outgoing: Outgoing, session: AsyncSession) -> None:
        self.outgoing = outgoing
        self.session = session
        #: (position, produced-so-far, slot, record): sorted by the first two when the batch ends.
        self.made: list[tuple[int, int, int | None, Produced]] = []
        self.dropped: set[int] = set()

    def add(self, topic: str, value: Any, key: Any, headers: Any, partition: int | None) -> None:
        record = self.outgoing.make(topic, value, key, headers, partition)
        slot = current_slot()
        self.made.append((self.session.position(slot), len(self.made), slot, record))

    def drop(self, slot: int) -> None:
        self.dropped.add(slot)

    def join(self) -> None:
        self.made.sort(key=operator.itemgetter(0, 1))
        dropped = self.dropped
        self.outgoing.records.extend(record for _, _, slot, record in self.made if slot not in dropped)


class _OutsideBatch:
    """What :attr:`Processor.session` is between batches: every use is a clear error."""

    def __getattr__(self, name: str) -> Any:
        raise KstoreError(
            f"Processor.session.{name}: the session only exists inside handle()/handle_batch(); "
            "use self.engine in setup(), teardown(), on_assigned(), on_revoked() and on_committed()"
        )

    def __repr__(self) -> str:
        return "<no session: outside a batch>"


class Processor:
    """Subclass this and implement :meth:`handle` (or :meth:`handle_batch`).

    Everything written through :attr:`session` commits in the same database
    transaction as the offsets of the batch, so each message's effect lands
    exactly once. Never commit the session yourself: the worker does, after
    writing the offsets, and a ``session.commit()`` here only releases a
    savepoint inside the worker's transaction.
    """

    #: Topics to consume.
    topics: ClassVar[Sequence[str]] = ()
    #: Topics :meth:`produce` writes to. Declared, the worker checks they exist before it starts, and
    #: ``produce()`` to any other topic stops the worker (:class:`~kstore.UndeclaredTopicError`).
    #: None: any topic, looked up at its first ``produce()``.
    produces: ClassVar[Sequence[str] | None] = None
    #: The pipeline's name: the Kafka group id and the key of its stored offsets.
    group: ClassVar[str | None] = None
    #: How :meth:`deserialize` turns keys and values into Python values.
    key_format: ClassVar[Format] = "bytes"
    value_format: ClassVar[Format] = "bytes"
    #: How a failing message is retried (attempts, backoff); see :mod:`kstore.retry`.
    retry: ClassVar[RetryPolicy] = RetryPolicy()
    #: After the last attempt: ``"stop"`` the worker (offset stays before the message) or
    #: ``"dead_letter"`` it (into kstore_dead_letters, in the transaction that moves past it).
    on_error: ClassVar[OnError] = "stop"
    #: Send one-row INSERTs executed through :attr:`session` together, as multi-row
    #: INSERTs, when anything else needs the database (see :mod:`kstore.db.session`).
    defer_inserts: ClassVar[bool] = True
    #: With ``async def handle``: most messages of a batch handled at once (setting ``max_concurrency``).
    max_concurrency: ClassVar[int] = 64
    #: With ``async def handle``: which messages run one after another, in offset order (setting
    #: ``ordering``): ``"key"`` (each key's; keyless ones their partition's), ``"partition"``, ``"none"``.
    ordering: ClassVar[Ordering] = "key"

    #: The SQLAlchemy session of the batch in flight; set by the worker for the length of
    #: ``handle``/``handle_batch`` only. Outside a batch it raises a clear error: a session
    #: used there would open a transaction that no batch ends.
    session: BatchSession = cast(BatchSession, _OutsideBatch())
    #: The worker's engine, set before :meth:`setup` (e.g. to create the processor's tables).
    #: Writes through it are NOT part of a batch's transaction: use :attr:`session` for effects.
    engine: Engine

    def setup(self) -> None:
        """Called once before the first message, after the worker connected.

        The workers of a group run it one at a time (on PostgreSQL, under an advisory lock of
        the group), so ``CREATE TABLE IF NOT EXISTS`` here never races another worker's. What it
        raises stops the worker's start (one line, exit 1)."""

    def teardown(self) -> None:
        """Called once when the worker stops."""

    def on_assigned(self, partitions: list[TopicPartition]) -> None:
        """Called after partitions were claimed and sought, before their first message."""

    def on_revoked(self, partitions: list[TopicPartition]) -> None:
        """Called when partitions were taken away (revoked, lost or fenced)."""

    def on_committed(self, msgs: Sequence[Message]) -> None:
        """Called after a batch committed (its effects and offsets are durable), with its messages.

        For work that must only follow a commit: metrics, telling another system. It is
        at most once: a crash right after the commit skips it. An exception here is
        logged; the batch stays committed.
        """

    def produce(self, topic: str, value: Any, *, key: Any = None,
                headers: Sequence[tuple[str, Any]] | dict[str, Any] | None = None,
                partition: int | None = None) -> None:
        """Produce a record to Kafka, exactly once: it is published if and only if this batch commits.

        The record is written to kstore's outbox in the batch's own transaction; a relay (in
        the worker, or ``kstore relay``) publishes it once that transaction committed, with a
        transactional producer, so a reader with ``isolation_level=read_committed`` sees it
        once, and one key's records in the order their batches committed. Within a batch, records
        keep the order produced; with ``async def handle``, the order of the database statements
        they follow (each right after its handler's last statement; docs/concurrency.md).

        ``value`` and ``key``: bytes as they are, ``str`` as UTF-8, None as none (a value of
        None is a tombstone), anything else as JSON. ``headers``: ``(name, value)`` pairs or a
        dict. ``partition``: the output partition (default: by key, as Kafka's producer does).
        A record that can never be published raises :class:`ProduceError` here. A topic not in
        :attr:`produces` (when declared) raises :class:`~kstore.UndeclaredTopicError`, which stops
        the worker; one the cluster does not have, :class:`~kstore.MissingTopicError`, which makes
        the batch wait for it. Neither is a fault of the message: neither is ever dead-lettered, and
        the batch fails even if the processor catches them.
        """
        outgoing = vars(self).get("_outgoing")
        if outgoing is None:
            raise KstoreError("Processor.produce() only works inside handle()/handle_batch(): what it "
                              "produces is published when (and only if) the batch commits")
        outgoing.add(topic, value, key, headers, partition)

    def deserialize(self, key: bytes | None, value: bytes | None) -> tuple[Any, Any]:
        """Turn a record's raw key and value into what :meth:`handle` receives."""
        return decode(key, self.key_format), decode(value, self.value_format)

    def handle(self, msg: Message) -> Awaitable[None] | None:
        """Process one message; write its effects through :attr:`session`. May be ``async def``:
        then a batch's messages run concurrently (see :mod:`kstore.concurrency`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement handle() or handle_batch()")

    def handle_batch(self, msgs: Sequence[Message]) -> Awaitable[None] | None:
        """Process a batch; the default calls :meth:`handle` for each message in order (an ``async def
        handle``: concurrently, by :attr:`max_concurrency` and :attr:`ordering`)."""
        handle = self.handle
        for msg in msgs:
            result = handle(msg)
            if result is not None:
                check_returned(self, "handle", result)
        return None


#: The hooks kstore calls; none may be ``async def`` (kstore would get a coroutine it never runs)...
HOOKS = ("setup", "teardown", "on_assigned", "on_revoked", "on_committed", "deserialize", "handle", "handle_batch")
#: ... but these, which kstore runs on the processor's event loop (:mod:`kstore.concurrency`).
ASYNC_HOOKS = ("setup", "teardown", "handle", "handle_batch")


def is_async_processor(processor: Processor) -> bool:
    """True if the processor's batches run on its event loop: ``async def handle`` or ``handle_batch``."""
    cls = type(processor)
    return is_async(cls.handle_batch) or (cls.handle_batch is Processor.handle_batch and is_async(cls.handle))


def check_returned(processor: Processor, hook: str, result: Any) -> None:
    """Refuse what a hook returned if it is an awaitable (a coroutine, a future, a task): kstore
    calls hooks synchronously, so it never ran, and a batch would commit its offsets with no
    effect. This catches an ``async def`` behind a plain decorator, which :func:`check_processor`
    cannot see. The coroutine is closed (no "never awaited" warning) and the worker stops."""
    if not inspect.isawaitable(result):
        return
    close = getattr(result, "close", None)
    if callable(close):
        close()
    raise ProcessorContractError(
        f"{type(processor).__name__}.{hook} returned {type(result).__name__} {getattr(result, '__qualname__', '')}"
        .rstrip() + ": kstore calls hooks synchronously, so it never ran and nothing of the batch was committed; "
        "make it a plain `def` (an `async def` behind a decorator is still a coroutine function; an "
        "undecorated `async def handle` runs concurrently, see docs/concurrency.md)")


def call_hook(processor: Processor, hook: str, *args: Any) -> Any:
    """Call ``processor.<hook>(*args)`` and check what it returned (see :func:`check_returned`); an
    ``async def setup`` or ``teardown`` runs on the processor's event loop."""
    fn = getattr(processor, hook)
    if hook in ("setup", "teardown") and is_async(fn):
        return run_on_loop(processor, fn(*args))
    result = fn(*args)
    if result is not None:
        check_returned(processor, hook, result)
    return result


def call_setup(processor: Processor, engine: Engine, group: str) -> None:
    """Give the processor ``engine`` and call its ``setup()`` under the group's setup lock
    (:mod:`kstore.db.setuplock`), so the DDL of workers that start together never races.

    What ``setup()`` raises becomes a :class:`~kstore.errors.ProcessorError` naming it (the
    original is its ``__cause__``): a worker or a replay that cannot start says why in one line.
    """
    processor.engine = engine
    with setup_lock(engine, group):
        try:
            call_hook(processor, "setup")
        except KstoreError:
            raise
        except Exception as exc:
            raise ProcessorError(f"{type(processor).__name__}.setup() failed: {type(exc).__name__}: "
                                 f"{first_line(exc)}") from exc


def check_processor(processor: Processor) -> None:
    """Refuse what kstore cannot run: an ``async def`` hook would return a coroutine that never
    runs, and the offsets of its messages would commit with no effect at all. ``async def`` is
    for ``handle``, ``handle_batch``, ``setup`` and ``teardown`` only (:mod:`kstore.concurrency`)."""
    cls, name_ = type(processor), type(processor).__name__
    for name in HOOKS:
        fn = getattr(cls, name, None)
        if inspect.isasyncgenfunction(fn) or (inspect.iscoroutinefunction(fn) and name not in ASYNC_HOOKS):
            raise ConfigurationError(
                f"{name_}.{name} is `async def`: kstore calls it synchronously, so its coroutine would never "
                f"run; use `def` (`async def` is for {', '.join(ASYNC_HOOKS)})")
    if is_async(cls.handle) and not is_async(cls.handle_batch) and cls.handle_batch is not Processor.handle_batch:
        raise ConfigurationError(
            f"{name_}.handle is `async def` but its handle_batch is a plain `def`, which would get coroutines "
            "it never runs; make handle_batch `async def` too, or remove it (the default runs handle concurrently)")
    check_concurrency(name_, processor.max_concurrency, processor.ordering)
    declared_topics(processor)


def check_concurrency(where: str, max_concurrency: Any, ordering: Any) -> None:
    if not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigurationError(f"{where}: max_concurrency must be a positive int, got {max_concurrency!r}")
    if ordering not in ORDERINGS:
        raise ConfigurationError(f"{where}: ordering must be one of {', '.join(ORDERINGS)}, got {ordering!r}")


class Spans(Protocol):
    """What :func:`run_handler` needs of a tracer: a span around a batch and one around a message.

    :class:`kstore.telemetry.tracing.Tracing` is one. Named here, so that calling a processor
    depends on no tracer (the tracer builds on :class:`Message`, not the other way round).
    """

    @property
    def enabled(self) -> bool: ...
    def batch(self, msgs: Sequence[Message]) -> AbstractContextManager[None]: ...
    def message(self, msg: Message) -> AbstractContextManager[None]: ...


def run_handler(processor: Processor, conn: Connection, msgs: Sequence[Message],
                tracing: Spans | None = None, rejects: list[tuple[int, Exception]] | None = None,
                outgoing: Outgoing | None = None, concurrency: Concurrency | None = None) -> None:
    """Call ``processor.handle_batch(msgs)`` with a session inside ``conn``'s open transaction.

    The session joins the caller's transaction as ``rollback_only``: a
    ``session.commit()`` by the processor only flushes, so the caller commits the
    processor's writes together with its own (the offsets, a dead letter's mark).
    With ``tracing`` enabled, the batch is a span, and so is each ``handle(msg)`` when
    the processor keeps the default ``handle_batch``.

    ``rejects``: with the default ``handle_batch``, a ``handle(msg)`` that raises a final
    error (:class:`~kstore.retry.Reject`, or one the retry policy gives up on) *before
    doing anything in the transaction* is appended here as ``(index, error)`` and the
    batch goes on: the caller dead-letters it in the same transaction. One that did
    something first (a statement, a flush) raises as any error does: the transaction,
    with whatever it wrote, is rolled back. What it produced before raising is dropped.

    ``outgoing``: collects what the processor produces (:meth:`Processor.produce`); the
    caller writes it to the outbox before committing. Without it, ``produce()`` raises.

    An async processor (``async def handle``) runs the batch's messages concurrently on its
    event loop, as ``concurrency`` says (default: the processor's own attributes); it returns
    only once every message has finished, and raises if any failed (see :mod:`kstore.concurrency`).
    """
    default = type(processor).handle_batch is Processor.handle_batch
    span = tracing if tracing is not None and tracing.enabled else None
    try:
        with batch_session(conn, defer_inserts=processor.defer_inserts) as session:
            processor.session = session
            if outgoing is not None:
                vars(processor)["_outgoing"] = outgoing
            with span.batch(msgs) if span is not None else contextlib.nullcontext():
                if is_async_processor(processor):
                    _run_async(processor, session, msgs, span, rejects, outgoing,
                               concurrency or Concurrency.of(processor))
                elif not default or (span is None and rejects is None):
                    # A coroutine, if it is an `async def` behind a plain decorator.
                    result: Any = cast(Any, processor).handle_batch(msgs)
                    if result is not None:
                        check_returned(processor, "handle_batch", result)
                else:
                    _handle_each(processor, session, msgs, span, rejects)
    except Exception as exc:
        _raise_refused(outgoing, exc)
        raise
    else:
        _raise_refused(outgoing, None)
    finally:
        # The session is closed; a hook that used it after the batch would begin a
        # transaction on the worker's connection that nothing ends.
        vars(processor).pop("session", None)
        vars(processor).pop("_outgoing", None)


def _raise_refused(outgoing: Outgoing | None, raised: Exception | None) -> None:
    """What ``produce()`` refused that is not the message's fault, raised even if the processor caught
    it (or failed otherwise after it): the batch cannot commit without the record, nor blame a message."""
    refused = outgoing.refused if outgoing is not None else None
    if refused is not None and refused is not raised:
        raise refused from raised


class Concurrency(NamedTuple):
    """How an async processor's batch runs: at most ``limit`` messages at once, in ``ordering``, and
    failed (its messages cancelled) if they have not all finished after ``timeout`` seconds."""

    limit: int
    ordering: Ordering
    timeout: float | None = None

    @classmethod
    def of(cls, processor: Processor, max_concurrency: int | None = None, ordering: str | None = None,
           timeout: float | None = None) -> Concurrency:
        """The processor's own, overridden by settings given here (``None``: the processor's)."""
        chosen = cast(Ordering, ordering or processor.ordering)
        limit = max_concurrency or processor.max_concurrency
        check_concurrency(type(processor).__name__, limit, chosen)
        return cls(limit, chosen, timeout)


def _run_async(processor: Processor, session: BatchSession, msgs: Sequence[Message], span: Spans | None,
               rejects: list[tuple[int, Exception]] | None, outgoing: Outgoing | None,
               concurrency: Concurrency) -> None:
    """An async processor's batch, on its event loop: ``self.session`` is the batch's session behind
    an :class:`AsyncSession`, and what it produces is kept in the database's order (see :class:`_InWriteOrder`)."""
    face = AsyncSession(session)
    processor.session = cast(BatchSession, face)
    produced = _InWriteOrder(outgoing, face) if outgoing is not None else None
    if produced is not None:
        vars(processor)["_outgoing"] = produced
    owner = type(processor).__name__
    if type(processor).handle_batch is Processor.handle_batch:
        run_on_loop(processor, _handle_concurrently(processor, face, msgs, span, rejects, produced, concurrency))
    else:
        run_on_loop(processor, _bounded(cast(Any, processor).handle_batch(msgs), concurrency.timeout))
        face.check_awaited(None, f"{owner}.handle_batch")
    if produced is not None:
        produced.join()


async def _bounded(coro: Any, timeout: float | None) -> None:
    await asyncio.wait_for(coro, timeout)


async def _handle_concurrently(processor: Processor, face: AsyncSession, msgs: Sequence[Message],
                               span: Spans | None, rejects: list[tuple[int, Exception]] | None,
                               produced: _InWriteOrder | None, concurrency: Concurrency) -> None:
    """``await handle(msg)`` for every message, concurrently (:func:`run_lanes`). A final error raised
    before the message used the session is set aside in ``rejects`` (as :func:`_handle_each` does)."""
    handle = processor.handle
    owner = f"{type(processor).__name__}.handle"

    async def one(index: int) -> None:
        set_slot(index)  # this task's own context: the session and produce() know the message
        face.started(index)  # records it produces before any statement still follow its lane's earlier ones
        msg = msgs[index]
        try:
            if span is None:
                await cast(Any, handle(msg))
            else:
                with span.message(msg):
                    await cast(Any, handle(msg))
        except NOT_THE_MESSAGE:
            raise
        except Exception as exc:
            if rejects is None or not processor.retry.gives_up_on(exc) or index in face.touched:
                raise
            if produced is not None:
                produced.drop(index)  # a rejected message produces nothing
            rejects.append((index, exc))
            return
        face.check_awaited(index, owner)

    await run_lanes(lanes(msgs, concurrency.ordering), one, concurrency.limit, concurrency.timeout)
    if rejects:
        rejects.sort(key=operator.itemgetter(0))  # dead-lettered in offset order, as one by one


def _handle_each(processor: Processor, session: BatchSession, msgs: Sequence[Message], span: Spans | None,
                 rejects: list[tuple[int, Exception]] | None) -> None:
    """The default ``handle_batch`` (``handle`` per message), with a span per message and
    final errors that touched nothing set aside in ``rejects`` (see :func:`run_handler`)."""
    handle = processor.handle
    outgoing = vars(processor).get("_outgoing")
    for index, msg in enumerate(msgs):
        mark = session.touches
        produced = len(outgoing.records) if outgoing is not None else 0
        try:
            if span is None:
                result = handle(msg)
            else:
                with span.message(msg):
                    result = handle(msg)
            if result is not None:
                check_returned(processor, "handle", result)
        except NOT_THE_MESSAGE:
            raise
        except Exception as exc:
            if rejects is None or not processor.retry.gives_up_on(exc) or not session.untouched(mark):
                raise
            if outgoing is not None:
                del outgoing.records[produced:]  # a rejected message produces nothing
            rejects.append((index, exc))


def _import_file(path: str) -> Any:
    """Import a processor's ``.py`` file by its path; its folder goes on ``sys.path`` first, so the
    modules beside it import as they do when it is run from there."""
    file = os.path.abspath(path)
    if not os.path.isfile(file):
        raise ImportError(f"no such file: {path}")
    folder, name = os.path.split(file)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name[:-3], file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_processor(path: str) -> Processor:
    """Import ``MODULE:CLASS`` and instantiate it; a clear error if it is not a Processor."""
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"processor must be MODULE:CLASS or path/to/file.py:CLASS, got {path!r}")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import processor module {module_name!r}: {exc}") from None
    except SyntaxError as exc:  # IndentationError too: the file is wrong, not kstore
        raise ConfigurationError(f"cannot import processor module {module_name!r}: {exc.msg} "
                                 f"({exc.filename}, line {exc.lineno})") from None
    cls: Any = getattr(module, attr, None)
    if cls is None:
        raise ConfigurationError(f"module {module_name!r} has no {attr!r}{_suggestion(module, attr)}")
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise ConfigurationError(f"{path} is not a kstore.Processor subclass")
    instance: Processor = cls()
    return instance


def _suggestion(module: Any, attr: str) -> str:
    """``; did you mean 'X'?`` for the module's Processor subclass closest to a mistyped name, or the
    ones it has when none is close."""
    found = sorted(name for name, value in vars(module).items()
                   if isinstance(value, type) and issubclass(value, Processor) and value is not Processor)
    by_lower = {name.lower(): name for name in found}  # `recorder` for `Recorder` is a typo too
    close = difflib.get_close_matches(attr.lower(), list(by_lower), n=1)
    if close:
        return f"; did you mean {by_lower[close[0]]!r}?"
    return f" (its Processor classes: {', '.join(found)})" if found else " (and no Processor class at all)"

