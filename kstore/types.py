"""kstore's shared vocabulary: the plain types every part of kstore (and a processor's hooks) names.

- a partition and a position in it, by plain values (:data:`TopicPartition`, :class:`Position`);
- a Kafka record as kstore holds it between fetching and committing (:class:`Record`), as the
  processor sees it (:class:`Message`), and as a processor produced it (:class:`Produced`);
- the choices a processor declares (:data:`Format`, :data:`OnError`, :data:`Ordering`).

Imports nothing of kstore's (and no Kafka client): the Kafka side, which fetches records, and the
database side, which stores one as a dead letter, never import each other but both import this.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple, Protocol, cast

#: A partition by plain values, ``(topic, partition_id)``: what users pass and the tables key on.
TopicPartition = tuple[str, int]

#: How :meth:`kstore.Processor.deserialize` turns keys and values into Python values.
Format = Literal["bytes", "str", "json", "avro", "protobuf", "json-schema"]
#: What happens after a message's last attempt: stop the worker, or dead-letter it.
OnError = Literal["stop", "dead_letter"]
#: Which messages of an async processor's batch run one after another (``ordering``).
Ordering = Literal["key", "partition", "none"]
ORDERINGS: tuple[Ordering, ...] = ("key", "partition", "none")


class Position(NamedTuple):
    """What a batch commits for one partition: the compare-and-set on its offsets row."""

    #: The ``next_offset`` the row must still hold (this worker's last commit, claim or reset).
    expected: int
    #: The ``next_offset`` written: one past the batch's last record of the partition.
    next: int
    #: The epoch the row must still hold (this worker's claim).
    epoch: int


class Record(Protocol):
    """A record as fetched and queued, before the processor deserializes it: what kstore reads of one.

    On kafka-python kstore queues the client's own record objects (ConsumerRecord) rather than
    copying each one: per-record work in the fetcher is what bounds throughput. On confluent-kafka
    it queues :class:`Message` tuples, built once by the fetch thread and handed to a processor that
    deserializes nothing as they are. The timestamp is named differently by the two (read it with
    :func:`timestamp_ms`).
    """

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> Any: ...
    @property
    def value(self) -> Any: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...


class Message(NamedTuple):
    """One Kafka record, as the processor sees it (key and value deserialized). Immutable.

    A named tuple rather than a dataclass: one is built per message, and a tuple is
    the cheapest immutable object Python makes. The time is kept in milliseconds
    and turned into a datetime only when asked for.
    """

    topic: str
    partition: int
    offset: int
    key: Any
    value: Any
    #: ``(name, value)`` pairs, as Kafka delivered them (empty when there are none).
    headers: Sequence[tuple[str, bytes | None]] = ()
    #: Kafka's timestamp in milliseconds since the epoch (None when the record has none).
    timestamp_ms: int | None = None

    @property
    def timestamp(self) -> datetime | None:
        """The record's timestamp as an aware UTC datetime (None when it has none)."""
        return ms_to_datetime(self.timestamp_ms)


def timestamp_ms(record: Record) -> int | None:
    """A queued record's Kafka timestamp in milliseconds (negative or None when it has none).

    kafka-python's records call it ``timestamp``; a :class:`Message` calls it ``timestamp_ms``
    (its ``timestamp`` is a datetime)."""
    if isinstance(record, Message):
        return record.timestamp_ms
    ms: int | None = cast(Any, record).timestamp
    return ms


def ms_to_datetime(ms: int | None) -> datetime | None:
    """A record's timestamp (milliseconds; -1 or None when it has none) as an aware datetime."""
    return None if ms is None or ms < 0 else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


class Produced(NamedTuple):
    """A record a processor produced (``Processor.produce``), serialized, waiting for its batch's commit.

    Written to the outbox in the batch's transaction (:mod:`kstore.relay.writing`) and published by
    the relay (:mod:`kstore.relay.loop`) once that transaction committed.
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
