"""A batch as taken from the queues (:class:`Batch`) and as the processor sees it (:class:`Decoded`,
built by :class:`Decoder`).

Deserializing is per message, so its failure is that message's own: the message is set aside with a
:class:`~kstore.retry.DeserializationError` (what becomes of it is the failure strategy's call, see
:mod:`kstore.engine.strategies`), never the batch's failure. A record whose schema id the registry
does not know is weighed first (:mod:`kstore.schemas.unknown`): a registry that lost its schemas is
an outage, raised for the batch to wait out. Used on the worker's main thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

from kstore.errors import RegistryUnavailableError
from kstore.kafka.seam import ConsumerSource
from kstore.processor import Processor
from kstore.retry import DeserializationError, Retry
from kstore.schemas.registry import UnknownSchemaError
from kstore.schemas.unknown import UnknownIds
from kstore.types import Message, Position, Record, timestamp_ms
from kstore.types import TopicPartition as TP

from .commit import HandlerFailed
from .failures import MessageKey


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch as taken: its records, and what it needs to commit (positions) or to be put back (generations)."""

    records: list[Record]
    #: Queue generation per partition when taken: a partition flushed since keeps its new position.
    generations: dict[TP, int]
    #: Per partition: (stored offset, offset after the batch, epoch) when taken. The commit
    #: matches the first and the last (compare-and-set), so it is fenced if either moved.
    positions: dict[TP, Position]
    #: Records per partition, when known as taken (else counted from ``records``).
    taken_counts: dict[TP, int] | None = None

    def counts(self) -> Mapping[TP, int]:
        """Records per partition (for the metrics)."""
        return counts(self.records) if self.taken_counts is None else self.taken_counts

    def first(self) -> MessageKey:
        """The batch's first message."""
        r = self.records[0]
        return r.topic, r.partition, r.offset


class Decoded(NamedTuple):
    """A batch as the processor sees it: its messages (deserialized) and, in the same order, their
    records; and the records whose key or value could not be deserialized, with the error."""

    msgs: list[Message]
    records: Sequence[Record]
    undecodable: list[tuple[Record, Exception]]


#: A kafka-python record's fields in :class:`Message` order, and a Message made from them (a tuple subclass).
_message_fields = operator.attrgetter("topic", "partition", "offset", "key", "value", "headers", "timestamp")
_new_message = functools.partial(tuple.__new__, Message)
_tp_of = operator.attrgetter("topic", "partition")
_topic_of = operator.itemgetter(0)  # a Message's topic


def counts(records: Sequence[Record]) -> Counter[TP]:
    """Messages per partition (C loops: this runs once per batch over every record)."""
    return Counter(map(_tp_of, records))


def before(item: Record | Message, ends: Mapping[TP, int]) -> bool:
    """Whether a record or message lies before its partition's end in ``ends`` (or has none there)."""
    end = ends.get((item.topic, item.partition))
    return end is None or item.offset < end


class Decoder:
    """Turns a batch's records into the processor's messages."""

    def __init__(self, processor: Processor, source: ConsumerSource) -> None:
        self.processor, self.source = processor, source
        #: Whether a record's unknown schema id is its own fault or the registry's (then waited out as an outage).
        self.unknown_ids = UnknownIds()
        # Raw bytes with the default deserialize(): skip a call per message.
        self._raw = (type(processor).deserialize is Processor.deserialize
                     and processor.key_format == "bytes" and processor.value_format == "bytes")

    def messages(self, batch: Sequence[Record]) -> Decoded:
        """The batch as the processor sees it. Raw bytes: built by C loops, no Python call per message.

        Deserializing is per message, so its failure is that message's own: it is set aside with
        a :class:`DeserializationError` (never the batch's failure, found by narrowing the batch
        down). A :class:`Retry` raised by a custom ``deserialize`` fails the batch, retried as usual.
        """
        if self._raw:
            if self.source.queues_messages:  # built by the fetch thread already
                return Decoded(cast(list[Message], list(batch)), batch, [])
            # tuple.__new__ mapped straight, not through a partial: a sixth less per message.
            return Decoded(list(map(tuple.__new__, itertools.repeat(Message), map(_message_fields, batch))), batch, [])
        deserialize = self.processor.deserialize
        messages: list[Message] = []
        undecodable: list[tuple[Record, Exception]] = []
        weighed = 0  # messages[:weighed] are told to self.unknown_ids already (as decoded)
        for r in batch:
            try:
                key, value = deserialize(r.key, r.value)
            except Retry as exc:
                raise HandlerFailed(str(exc)) from exc
            except RegistryUnavailableError:
                raise  # an outage: the batch waits (never the record's fault)
            except Exception as exc:
                if isinstance(exc, UnknownSchemaError):
                    weighed = self._weigh_unknown(r, exc, messages, weighed)
                undecodable.append((r, DeserializationError.of(exc)))
                continue
            messages.append(_new_message((r.topic, r.partition, r.offset, key, value, r.headers, timestamp_ms(r))))
        self.unknown_ids.decoded(set(map(_topic_of, messages[weighed:] if weighed else messages)))
        if not undecodable:
            return Decoded(messages, batch, [])
        bad = {id(r) for r, _ in undecodable}
        return Decoded(messages, [r for r in batch if id(r) not in bad], undecodable)

    def _weigh_unknown(self, record: Record, exc: UnknownSchemaError, messages: list[Message], weighed: int) -> int:
        """A record names a schema id the registry does not have: raise the outage it is a sign of (the
        registry knows nothing of its topic, or several ids in a row: see :mod:`kstore.schemas.unknown`),
        else leave it the record's fault. The messages decoded since the last one weighed are told
        first (they break a row of unknown ids); returns how many messages are told now."""
        self.unknown_ids.decoded(set(map(_topic_of, messages[weighed:])))
        outage = self.unknown_ids.blame(record.topic, exc)
        if outage is not None:
            raise outage from exc
        return len(messages)
