"""Helpers for testing your own processors without Kafka.

::

    from kstore.testing import make_message, run_batch

    def test_counts_views(tmp_path):
        engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 't.db'}")
        counter = PageViewCounter()
        run_batch(counter, [make_message({"page": "/"}), make_message({"page": "/"}, offset=1)], engine)
        ...

``run_batch`` runs ``handle_batch`` the way the worker does: in one transaction,
through ``processor.session`` (a ``session.commit()`` inside only flushes), with
``setup()`` called first; if the processor raises, nothing of the batch commits.
An ``async def handle`` runs as in the worker too: the messages concurrently, on the
processor's event loop, by its ``max_concurrency`` and ``ordering``.
What the processor produced (``self.produce``) comes back in the outcome, serialized as the
relay would publish it (nothing is published)::

    outcome = run_batch(booker, [make_message({"account": "a1", "amount": 5})], engine)
    assert [json.loads(r.value) for r in outcome.produced] == [{"account": "a1", "booked": 5}]

With ``on_error = "dead_letter"`` (the processor's, or ``run_batch(..., on_error=...)``) a message
the worker would dead-letter comes back in ``outcome.rejected`` with its error, and the rest of
the batch commits, as in the worker; ``outcome.committed`` lists the messages handled. A message
made with ``raw=True`` carries Kafka's bytes and is deserialized by the processor, as the worker
does, so a payload that cannot be deserialized shows up as rejected::

    outcome = run_batch(counter, [make_message(b'{"page": "/"}', raw=True), make_message(b"{oops", raw=True,
                                  offset=1)], engine, on_error="dead_letter")
    assert [m.offset for m in outcome.committed] == [0]
    assert [(r.message.offset, type(r.error).__name__) for r in outcome.rejected] == [(1, "DeserializationError")]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, create_engine

from kstore.db.setuplock import setup_lock
from kstore.processor import Processor
from kstore.retry import DeserializationError
from kstore.running.handler import NOT_THE_MESSAGE, Outgoing, produce_check, run_handler
from kstore.running.hooks import call_hook, check_processor, declared_topics, deserialized, to_ms
from kstore.schemas import Registry, Schema
from kstore.schemas.formats import bind as bind_formats
from kstore.settings import Settings
from kstore.types import Message, OnError, Produced


class RawMessage(Message):
    """A message as Kafka delivers it (``make_message(..., raw=True)``): key and value are bytes,
    which :func:`run_batch` deserializes with the processor's ``deserialize()``."""

    __slots__ = ()


@dataclass(frozen=True)
class Rejected:
    """A message the worker would dead-letter (``on_error = "dead_letter"``), and why."""

    #: As the processor saw it (as given, for one that could not be deserialized).
    message: Message
    #: A :class:`~kstore.Reject`, an error the retry policy gives up on, or a
    #: :class:`~kstore.DeserializationError` (its ``__cause__`` is the original).
    error: Exception


@dataclass(frozen=True)
class Outcome:
    """What a batch run by :func:`run_batch` did besides its database writes."""

    #: The records it produced (``Processor.produce``), in order, as the relay would publish them.
    produced: list[Produced] = field(default_factory=list)
    #: The messages handled in the committed transaction, in order.
    committed: list[Message] = field(default_factory=list)
    #: The messages dead-lettered (with on_error="dead_letter"), in the order given.
    rejected: list[Rejected] = field(default_factory=list)


def make_message(
    value: Any,
    *,
    topic: str = "test",
    partition: int = 0,
    offset: int = 0,
    key: Any = None,
    headers: Sequence[tuple[str, bytes | None]] = (),
    timestamp: datetime | None = None,
    raw: bool = False,
) -> Message:
    """A :class:`Message` as the processor would receive it (key and value already deserialized).

    ``raw=True``: ``value`` and ``key`` are Kafka's bytes (or None), deserialized by :func:`run_batch`
    with the processor's ``deserialize()`` (its ``key_format``/``value_format``), as the worker does.
    """
    ms = to_ms(timestamp or datetime.now(timezone.utc))
    if not raw:
        return Message(topic, partition, offset, key, value, tuple(headers), ms)
    for name, data in (("value", value), ("key", key)):
        if data is not None and not isinstance(data, bytes):
            raise TypeError(f"make_message(raw=True): {name} must be bytes or None, got {type(data).__name__}")
    return RawMessage(topic, partition, offset, key, value, tuple(headers), ms)


class InMemoryRegistry:
    """A schema registry in memory, for :func:`run_batch` with a processor that reads or writes schemas:
    the test's schemas go in as records are encoded with them (:meth:`encode`), and what the processor
    produced is read back with :meth:`decode`::

        registry = InMemoryRegistry()
        raw = registry.encode("orders", {"id": 1, "customer": "c1", "amount": 9.5}, Avro(ORDER))
        outcome = run_batch(Orders(), [make_message(raw, topic="orders", raw=True)], engine, registry=registry)
        assert registry.decode(outcome.produced[0].value) == {"order_id": 1, "total_cents": 950}

    It is confluent-kafka's own in-memory client, so ids, subjects and the wire format are the real ones.
    """

    def __init__(self) -> None:
        self.registry = Registry.in_memory()

    def encode(self, topic: str, value: Any, schema: Schema, *, key: bool = False) -> bytes:
        """``value`` in ``schema``'s wire format, as a producer would write it to ``topic`` (its schema registered)."""
        from kstore.schemas import Formats

        encoded = Formats(registry=lambda: self.registry).encode(topic, value, schema, key)
        if encoded is None:
            raise TypeError("InMemoryRegistry.encode(): None is not encoded (a tombstone stays None)")
        return encoded

    def decode(self, data: bytes, fmt: str = "avro", model: Any = None) -> Any:
        """A produced key or value read back (``fmt``: ``avro``, ``json-schema``; ``protobuf`` with its ``model``)."""
        from kstore.schemas import Formats

        return Formats(value_format=fmt, value_model=model, registry=lambda: self.registry).decode(None, data)[1]


def run_batch(processor: Processor, messages: Sequence[Message], engine: Engine | str, *,
              on_error: OnError | None = None, settings: Settings | None = None,
              registry: InMemoryRegistry | None = None) -> Outcome:
    """Run ``processor.handle_batch(messages)`` in one committed transaction on ``engine`` (or a URL).

    ``on_error`` (default: the processor's) as the worker applies it: with ``"stop"`` whatever the
    processor raises is raised here, and nothing commits. With ``"dead_letter"``, a message the worker
    would dead-letter at once (a :class:`~kstore.Reject` or an error of ``retry.give_up_on``, or a
    raw message that cannot be deserialized) is left out of the batch and returned in
    ``Outcome.rejected``; if such an error comes after the message wrote something, it is found by
    halving the batch in transactions that are rolled back, as the worker narrows a batch down, and
    the rest runs again. Any other error is raised (the worker would retry it), nothing committed.

    What the processor produces is checked as the worker checks it (no broker is asked): a record over
    ``outbox_max_record_bytes`` (of ``settings``, default :class:`~kstore.settings.Settings`' own) is a
    :class:`~kstore.ProduceError`, and a topic missing from a declared ``produces`` raises
    :class:`~kstore.UndeclaredTopicError`, whatever ``on_error`` says.

    ``registry``: where a processor with schemas (``value_format = "avro"``, ``output_schemas``) finds
    them, an :class:`InMemoryRegistry`; without it, the registry of ``settings`` (if any).
    """
    check_processor(processor)
    bind_formats(processor, settings or Settings(), registry.registry if registry is not None else None)
    check = produce_check(None, (settings or Settings()).outbox_max_record_bytes, produces=declared_topics(processor))
    if isinstance(engine, str):
        engine = create_engine(engine)
    if getattr(processor, "engine", None) is not engine:
        processor.engine = engine
        # Under the setup lock the worker takes, so test runs in parallel (pytest-xdist) on one
        # PostgreSQL database never race each other's CREATE TABLE; what setup() raises is raised as is.
        with setup_lock(engine, processor.group or f"{type(processor).__module__}.{type(processor).__qualname__}"):
            call_hook(processor, "setup")
    dead_letter = (on_error or processor.on_error) == "dead_letter"
    rejected: list[tuple[int, Rejected]] = []
    items: list[tuple[int, Message]] = []  # position given, the message as the processor sees it
    for position, msg in enumerate(messages):
        try:
            items.append((position, _deserialized(processor, msg)))
        except DeserializationError as exc:
            if not dead_letter:
                raise
            rejected.append((position, Rejected(msg, exc)))
    while True:
        outgoing = Outgoing(check)
        rejects: list[tuple[int, Exception]] | None = [] if dead_letter else None
        try:
            _run(processor, engine, [m for _, m in items], rejects, outgoing, commit=True)
            break
        except Exception as exc:
            if not dead_letter or not processor.retry.gives_up_on(exc) or isinstance(exc, NOT_THE_MESSAGE):
                raise
            found = _culprit(lambda msgs: _trial(processor, engine, msgs, check), [m for _, m in items])
            if found is None:
                raise
            index, error = found
            rejected.append((items[index][0], Rejected(items[index][1], error)))
            del items[index]
    set_aside = {index for index, _ in rejects or ()}
    rejected += [(items[index][0], Rejected(items[index][1], error)) for index, error in rejects or ()]
    return Outcome(list(outgoing.records), [m for i, (_, m) in enumerate(items) if i not in set_aside],
                   [r for _, r in sorted(rejected, key=lambda item: item[0])])


def _deserialized(processor: Processor, msg: Message) -> Message:
    if not isinstance(msg, RawMessage):
        return msg
    return deserialized(processor, msg.topic, msg.partition, msg.offset, msg.key, msg.value, msg.headers,
                        msg.timestamp_ms)


def _run(processor: Processor, engine: Engine, msgs: list[Message], rejects: list[tuple[int, Exception]] | None,
         outgoing: Outgoing, *, commit: bool) -> None:
    """The batch in one transaction, committed (or rolled back: a trial)."""
    if not msgs:
        return
    with engine.connect() as conn, conn.begin() as trans:
        run_handler(processor, conn, msgs, rejects=rejects, outgoing=outgoing)
        if not commit:
            trans.rollback()


def _trial(processor: Processor, engine: Engine, msgs: list[Message],
           check: Callable[[Produced], None]) -> Exception | None:
    """The final error ``msgs`` fail with, run in a transaction that is rolled back; None if they do not
    fail (another error is raised: the worker would retry it, and :func:`run_batch` raises it)."""
    try:
        _run(processor, engine, msgs, [], Outgoing(check), commit=False)
    except Exception as exc:
        if not processor.retry.gives_up_on(exc) or isinstance(exc, NOT_THE_MESSAGE):
            raise
        return exc
    return None


def _culprit(trial: Callable[[list[Message]], Exception | None],
             msgs: list[Message]) -> tuple[int, Exception] | None:
    """The position of a message that fails alone with a final error, and that error: the failing
    range halved as the worker narrows a batch down. None if no single message does."""
    lo, hi = 0, len(msgs)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(msgs[lo:mid]) is not None:
            hi = mid
        else:
            lo = mid
    error = trial(msgs[lo:hi]) if hi > lo else None
    return None if error is None else (lo, error)
