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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, create_engine

from kstore.processor import Message, Outgoing, Processor, call_hook, check_processor, run_handler, to_ms
from kstore.records import Produced


@dataclass(frozen=True)
class Outcome:
    """What a batch run by :func:`run_batch` did besides its database writes."""

    #: The records it produced (``Processor.produce``), in order, as the relay would publish them.
    produced: list[Produced] = field(default_factory=list)


def make_message(
    value: Any,
    *,
    topic: str = "test",
    partition: int = 0,
    offset: int = 0,
    key: Any = None,
    headers: Sequence[tuple[str, bytes | None]] = (),
    timestamp: datetime | None = None,
) -> Message:
    """A :class:`Message` as the processor would receive it (key and value already deserialized)."""
    return Message(topic, partition, offset, key, value, tuple(headers), to_ms(timestamp or datetime.now(timezone.utc)))


def run_batch(processor: Processor, messages: Sequence[Message], engine: Engine | str) -> Outcome:
    """Run ``processor.handle_batch(messages)`` in one committed transaction on ``engine`` (or a URL)."""
    check_processor(processor)
    if isinstance(engine, str):
        engine = create_engine(engine)
    if getattr(processor, "engine", None) is not engine:
        processor.engine = engine
        call_hook(processor, "setup")
    outgoing = Outgoing()
    with engine.connect() as conn, conn.begin():
        run_handler(processor, conn, list(messages), outgoing=outgoing)
    return Outcome(list(outgoing.records))
