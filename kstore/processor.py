"""What a user writes: the :class:`Processor` base class, and the :class:`Message` its handlers receive.

How kstore runs a processor (a batch's session, the async lanes, what ``produce()`` checks, the
checks of what hooks return, finding one by name) is :mod:`kstore.running`, shared by the engine,
the operator's tools and :mod:`kstore.testing`: nothing here runs a batch.

Invariants: :attr:`Processor.session` exists only for the length of a batch (outside one, every
use is a clear error), and :meth:`Processor.produce` only works inside one.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kstore.errors import KstoreError, ProcessorContractError
from kstore.retry import RetryPolicy
from kstore.schemas.formats import formats_of
from kstore.types import Format, OnError, Ordering
from kstore.types import Message as Message  # re-exported: users import it from here

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from kstore.db.session import BatchSession
    from kstore.schemas import Schema
    from kstore.types import TopicPartition

__all__ = ["Message", "Processor"]


def _check_returned(processor: Processor, hook: str, result: Any) -> None:
    """Refuse what a hook returned if it is an awaitable (a coroutine, a future, a task): kstore
    calls hooks synchronously, so it never ran, and a batch would commit its offsets with no
    effect. This catches an ``async def`` behind a plain decorator, which
    :func:`kstore.running.hooks.check_processor` cannot see. The coroutine is closed (no "never
    awaited" warning) and the worker stops.

    Here because the default :meth:`Processor.handle_batch` checks each ``handle``;
    :mod:`kstore.running.hooks` checks every hook kstore calls with it."""
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
    #: How :meth:`deserialize` turns keys and values into Python values: ``bytes``, ``str``, ``json``, or
    #: through a schema registry (``schema_registry_url``) ``avro``, ``protobuf``, ``json-schema``.
    key_format: ClassVar[Format] = "bytes"
    value_format: ClassVar[Format] = "bytes"
    #: A pydantic model or a dataclass each value is made into (``msg.value`` is an instance), from
    #: ``json``, ``avro`` or ``json-schema``; a value that does not fit is the message's fault
    #: (a :class:`~kstore.DeserializationError`). With ``protobuf``: the generated message class.
    value_model: ClassVar[Any] = None
    #: With ``value_format = "avro"``: the schema values are read as (JSON text), resolved from the
    #: schema each was written with (Avro's schema evolution); None: as written.
    value_schema: ClassVar[str | None] = None
    #: The schema :meth:`produce` writes each output topic's values (and keys) with, by topic; a
    #: ``schema=`` (``key_schema=``) given to ``produce()`` wins. See :mod:`kstore.schemas`.
    output_schemas: ClassVar[Mapping[str, Schema]] = {}
    output_key_schemas: ClassVar[Mapping[str, Schema]] = {}
    #: How a failing message is retried (attempts, backoff); see :mod:`kstore.retry`.
    retry: ClassVar[RetryPolicy] = RetryPolicy()
    #: After the last attempt: ``"stop"`` the worker (offset stays before the message) or
    #: ``"dead_letter"`` it (into kstore_dead_letters, in the transaction that moves past it).
    on_error: ClassVar[OnError] = "stop"
    #: With ``on_error = "dead_letter"``: a Kafka topic each dead letter is also produced to, through the
    #: outbox in the transaction that writes it, so the topic holds each letter exactly once: the
    #: original key, value and headers, and headers naming the error, the source topic, partition
    #: and offset, and the attempts (Spring Kafka's ``kafka_dlt-*``). The letter in the database stays
    #: what ``kstore dead-letters`` replays. None: no topic.
    dead_letter_topic: ClassVar[str | None] = None
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
    session: BatchSession = cast("BatchSession", _OutsideBatch())
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
                partition: int | None = None, schema: Schema | None = None, key_schema: Schema | None = None) -> None:
        """Produce a record to Kafka, exactly once: it is published if and only if this batch commits.

        The record is written to kstore's outbox in the batch's own transaction; a relay (in
        the worker, or ``kstore relay``) publishes it once that transaction committed, with a
        transactional producer, so a reader with ``isolation_level=read_committed`` sees it
        once, and one key's records in the order their batches committed. Within a batch, records
        keep the order produced; with ``async def handle``, the order of the database statements
        they follow (each right after its handler's last statement; docs/concurrency.md).

        ``value`` and ``key``: bytes as they are, ``str`` as UTF-8, None as none (a value of
        None is a tombstone), anything else as JSON; with a ``schema`` (``key_schema``), or one in
        :attr:`output_schemas` for the topic, in that schema's format through the schema registry (a
        dict, a dataclass, a pydantic model; a value that does not fit fails the batch, by policy).
        ``headers``: ``(name, value)`` pairs or a dict. ``partition``: the output partition (default:
        by key, as Kafka's producer does).
        A record that can never be published raises :class:`~kstore.ProduceError` here. A topic not in
        :attr:`produces` (when declared) raises :class:`~kstore.UndeclaredTopicError`, which stops
        the worker; one the cluster does not have, :class:`~kstore.MissingTopicError`, which makes
        the batch wait for it. Neither is a fault of the message: neither is ever dead-lettered, and
        the batch fails even if the processor catches them.
        """
        outgoing = vars(self).get("_outgoing")
        if outgoing is None:
            raise KstoreError("Processor.produce() only works inside handle()/handle_batch(): what it "
                              "produces is published when (and only if) the batch commits")
        outgoing.add(topic, value, key, headers, partition,
                     self.output_schemas.get(topic) if schema is None else schema,
                     self.output_key_schemas.get(topic) if key_schema is None else key_schema)

    def deserialize(self, key: bytes | None, value: bytes | None) -> tuple[Any, Any]:
        """Turn a record's raw key and value into what :meth:`handle` receives (by ``key_format``,
        ``value_format`` and ``value_model``)."""
        return formats_of(self).decode(key, value)

    def handle(self, msg: Message) -> Awaitable[None] | None:
        """Process one message; write its effects through :attr:`session`. May be ``async def``:
        then a batch's messages run concurrently (see :mod:`kstore.running.concurrency`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement handle() or handle_batch()")

    def handle_batch(self, msgs: Sequence[Message]) -> Awaitable[None] | None:
        """Process a batch; the default calls :meth:`handle` for each message in order (an ``async def
        handle``: concurrently, by :attr:`max_concurrency` and :attr:`ordering`)."""
        handle = self.handle
        for msg in msgs:
            result = handle(msg)
            if result is not None:
                _check_returned(self, "handle", result)
        return None
