"""The relay's shard publisher on the stub cluster: :class:`StubShardPublisher`, a transport that
satisfies :class:`kstore.relay.publisher.ShardPublisher`.

A transaction is atomic and instant: :meth:`StubShardPublisher.publish` checks every record first
(its topic and partition exist, its size is within ``max_record_bytes``), then appends the records
and the lane's progress record (given encoded: :mod:`kstore.relay.progress`) together, or nothing. Making a
publisher for a lane fences the lane's earlier one (the transactional id's epoch), whose next
publish raises :class:`~kstore.kafka.seam.Fenced`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kstore.kafka.seam import Fenced, PublishFailed
from kstore.types import Produced
from kstore.types import TopicPartition as TP

if TYPE_CHECKING:
    from kstore.settings import Settings

    from .cluster import Brokers


class StubShardPublisher:
    """A transactional producer for one lane of one group's outbox, on the stub cluster."""

    def __init__(self, cluster: Brokers, settings: Settings, transactional_id: str, max_record_bytes: int) -> None:
        self.cluster = cluster
        self.settings = settings
        self.ident = transactional_id
        self._max_record_bytes = max_record_bytes
        epochs = cluster.producer_epochs
        self._epoch = epochs[self.ident] = epochs.get(self.ident, 0) + 1
        self._closed = False

    def publish(self, records: Sequence[Produced], mark: Produced, timeout_s: float) -> None:
        with self.cluster.lock:  # a transaction: every record and the mark, at once, or nothing
            if self._closed or self.cluster.producer_epochs.get(self.ident) != self._epoch:
                raise Fenced(f"the transactional id {self.ident} was initialised by a newer producer")
            placed: list[TP] = []
            for row, record in enumerate(records):
                count = self.cluster.partition_count(record.topic)
                if not count:
                    raise PublishFailed(f"unknown topic {record.topic!r}", row)
                if record.partition is not None and not 0 <= record.partition < count:
                    raise PublishFailed(f"topic {record.topic!r} has no partition {record.partition}", row)
                if record.size() > self._max_record_bytes:
                    raise PublishFailed(f"a record of {record.size()} bytes is over {self._max_record_bytes}", row)
                partition = record.partition if record.partition is not None else _partition_of(record.key, count)
                placed.append((record.topic, partition))
            progress = (mark.topic, 0 if mark.partition is None else mark.partition)
            if progress not in self.cluster.logs:
                raise PublishFailed(f"the progress topic has no partition {progress[0]}[{progress[1]}]")
            for (topic, partition), record in zip(placed, records, strict=True):
                self.cluster.produce(topic, partition, record.value, record.key, _headers(record))
            self.cluster.produce(progress[0], progress[1], mark.value, mark.key)

    def close(self) -> None:
        self._closed = True


def _partition_of(key: bytes | None, count: int) -> int:
    """A stable partition by key (a keyless record goes to partition 0)."""
    return 0 if key is None else zlib.crc32(key) % count


def _headers(record: Produced) -> list[tuple[str, bytes]]:
    return [(name, value or b"") for name, value in record.headers]
