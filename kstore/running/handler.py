"""Running one batch of a processor: :func:`run_handler`, the same for a worker, a dead letter's
replay and :func:`kstore.testing.run_batch`; and what :meth:`~kstore.Processor.produce` collects
(:class:`Outgoing`) and checks a record against (:func:`produce_check`).

Invariants: the processor's writes join the caller's open transaction, which only the caller
commits; a message set aside as rejected wrote nothing and produces nothing; what ``produce()``
refused that is not the message's fault (:data:`NOT_THE_MESSAGE`) fails the batch even if the
processor caught it; a processor object runs one batch at a time (another thread's is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, cast

from sqlalchemy import Connection

from kstore.db.session import BatchSession, batch_session
from kstore.errors import MissingTopicError, ProcessorContractError, RegistryUnavailableError, UndeclaredTopicError
from kstore.processor import Processor
from kstore.retry import ProduceError
from kstore.schemas import Formats, Schema
from kstore.schemas.formats import formats_of
from kstore.types import Message, Ordering, Produced

from .concurrency import AsyncSession, current_slot, lanes, run_lanes, run_on_loop, set_slot
from .hooks import check_concurrency, check_returned, is_async_processor


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


#: What :meth:`~kstore.Processor.produce` raises that is neither a message's fault nor to be caught by the
#: processor: a topic missing from ``produces`` (a programming error), or an outage (a topic missing
#: from the cluster, a schema registry that does not answer).
NOT_THE_MESSAGE = (ProcessorContractError, MissingTopicError, RegistryUnavailableError)


def produce_check(partitions: Callable[[str], int | None] | None, max_bytes: int,
                  where: str = "Kafka", produces: frozenset[str] | None = None) -> Callable[[Produced], None]:
    """What :meth:`~kstore.Processor.produce` checks a record against before it goes to the outbox, the same
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
    """The records a batch produced (:meth:`~kstore.Processor.produce`), written to the outbox with its
    commit. ``check`` (see :func:`produce_check`) refuses a record that could never be published,
    at once; what it raised that is not the message's fault (:data:`NOT_THE_MESSAGE`) is kept in
    ``refused``, so the batch fails even if the processor caught it."""

    def __init__(self, check: Callable[[Produced], None] | None = None) -> None:
        self.records: list[Produced] = []
        self._check = check
        self.refused: Exception | None = None
        #: The processor's formats, for records produced with a schema (set by :func:`run_handler`).
        self.formats: Formats | None = None

    def add(self, topic: str, value: Any, key: Any, headers: Any, partition: int | None,
            schema: Schema | None = None, key_schema: Schema | None = None) -> None:
        self.records.append(self.make(topic, value, key, headers, partition, schema, key_schema))

    def make(self, topic: str, value: Any, key: Any, headers: Any, partition: int | None,
             schema: Schema | None = None, key_schema: Schema | None = None) -> Produced:
        """The record, serialized and checked (:class:`ProduceError` if it could never be published)."""
        if not isinstance(topic, str) or not topic:
            raise ProduceError(f"produce() needs a topic name, got {topic!r}")
        if partition is not None and (not isinstance(partition, int) or partition < 0):
            raise ProduceError(f"produce(): partition must be a non-negative int, got {partition!r}")
        try:
            value_bytes = self._encode(topic, value, schema, False)
            key_bytes = self._encode(topic, key, key_schema, True)
            record = Produced(topic, value_bytes, key_bytes, _headers(headers), partition)
            if self._check is not None:
                self._check(record)
        except NOT_THE_MESSAGE as exc:
            self.refused = self.refused or exc
            raise
        return record

    def _encode(self, topic: str, data: Any, schema: Schema | None, is_key: bool) -> bytes | None:
        if schema is None:
            return encode(data, "key" if is_key else "value")
        if self.formats is None:
            raise ProcessorContractError("produce() with a schema: this runner binds no formats")
        return self.formats.encode(topic, data, schema, is_key)


class _InWriteOrder:
    """What :meth:`~kstore.Processor.produce` adds to in a batch of concurrent handlers.

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

    def add(self, topic: str, value: Any, key: Any, headers: Any, partition: int | None,
            schema: Schema | None = None, key_schema: Schema | None = None) -> None:
        record = self.outgoing.make(topic, value, key, headers, partition, schema, key_schema)
        slot = current_slot()
        self.made.append((self.session.position(slot), len(self.made), slot, record))

    def drop(self, slot: int) -> None:
        self.dropped.add(slot)

    def join(self) -> None:
        self.made.sort(key=operator.itemgetter(0, 1))
        dropped = self.dropped
        self.outgoing.records.extend(record for _, _, slot, record in self.made if slot not in dropped)


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

    ``outgoing``: collects what the processor produces (:meth:`~kstore.Processor.produce`); the
    caller writes it to the outbox before committing. Without it, ``produce()`` raises.

    An async processor (``async def handle``) runs the batch's messages concurrently on its
    event loop, as ``concurrency`` says (default: the processor's own attributes); it returns
    only once every message has finished, and raises if any failed (see :mod:`kstore.running.concurrency`).

    One processor object runs one batch at a time: a call while another thread's batch of it runs
    raises :class:`~kstore.errors.ProcessorContractError` before anything runs.
    """
    default = type(processor).handle_batch is Processor.handle_batch
    span = tracing if tracing is not None and tracing.enabled else None
    claimed = _claim(processor)  # before the try: a refused call must not end the other thread's batch
    try:
        with batch_session(conn, defer_inserts=processor.defer_inserts) as session:
            processor.session = session
            if outgoing is not None:
                vars(processor)["_outgoing"] = outgoing
                outgoing.formats = formats_of(processor)
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
        if claimed:
            with _batches_lock:
                del _batches[id(processor)]


#: The thread running a batch of each processor object, by ``id`` (a processor need not be
#: hashable): an entry lives only while its batch runs, so no other object has that id then.
_batches: dict[int, int] = {}
_batches_lock = threading.Lock()


def _claim(processor: Processor) -> bool:
    """Mark ``processor`` as running a batch in this thread: True if this call marked it (a call nested
    in this thread's batch leaves the mark to the outer one). A batch of it running in another thread
    raises: both would set ``processor.session``, and one's writes would land in the other's transaction."""
    key, me = id(processor), threading.get_ident()
    with _batches_lock:
        holder = _batches.get(key)
        if holder is None:
            _batches[key] = me
    if holder is not None and holder != me:
        raise ProcessorContractError(f"{type(processor).__name__} is running a batch in another thread: a Processor "
                                     f"runs one batch at a time; give each thread its own processor")
    return holder is None


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
