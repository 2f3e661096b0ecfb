"""A Kafka record as kstore holds it between fetching and committing: the vocabulary both sides share.

The Kafka side (:mod:`kstore.kafka`) fetches records and queues them; the database side
(:mod:`kstore.db`) stores one as a dead letter. Neither imports the other: both import this,
which imports nothing of kstore's (and not kafka-python).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import NamedTuple, Protocol

#: A partition by plain values, ``(topic, partition_id)``: what users pass and the tables key on.
TopicPartition = tuple[str, int]


class Record(Protocol):
    """A record as fetched (kafka-python's ConsumerRecord), before the processor deserializes it.

    kstore queues kafka-python's own record objects rather than copying each one:
    per-record work in the fetcher is what bounds throughput.
    """

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...
    @property
    def serialized_key_size(self) -> int: ...
    @property
    def serialized_value_size(self) -> int: ...


def ms_to_datetime(ms: int | None) -> datetime | None:
    """A record's timestamp (milliseconds; -1 or None when it has none) as an aware datetime."""
    return None if ms is None or ms < 0 else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


class Produced(NamedTuple):
    """A record a processor produced (``Processor.produce``), serialized, waiting for its batch's commit.

    Written to the outbox in the batch's transaction (:mod:`kstore.db.outbox`) and published by
    the relay (:mod:`kstore.engine.relay`) once that transaction committed.
    """

    topic: str
    value: bytes | None
    key: bytes | None = None
    #: ``(name, value)`` pairs, Kafka's headers.
    headers: tuple[tuple[str, bytes | None], ...] = ()
    #: The output partition, or None for the producer's partitioner (by key).
    partition: int | None = None

    def size(self) -> int:
        """The bytes of key, value and headers (what a broker's size limit counts, without framing)."""
        return (len(self.key or b"") + len(self.value or b"")
                + sum(len(n) + len(v or b"") for n, v in self.headers))
