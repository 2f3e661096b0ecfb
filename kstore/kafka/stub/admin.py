"""The operator's questions to the stub cluster: :class:`StubAdmin`, an :class:`~kstore.kafka.seam.AdminReader`.

Answers at once from the cluster's state; a group's offsets can be committed only while it has no
live member (as Kafka refuses them otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from kstore.errors import BrokerError
from kstore.kafka.seam import Committed, GroupView, offsets_refused
from kstore.types import TopicPartition as TP

from .consumer import offsets_for_times

if TYPE_CHECKING:
    from kstore.settings import Settings

    from .cluster import Brokers


class StubAdmin:
    """The stub cluster's :class:`~kstore.kafka.seam.AdminReader` (see the module's docstring)."""

    def __init__(self, cluster: Brokers, settings: Settings | None = None) -> None:
        self.cluster = cluster
        self.servers = settings.bootstrap_servers if settings is not None else "stub"

    def connect(self) -> None:
        pass

    def partitions(self, topic: str) -> list[int]:
        return sorted(p for t, p in self.cluster.logs if t == topic)

    def _known(self, tps: Sequence[TP] | Mapping[TP, object]) -> None:
        unknown = sorted(tp for tp in tps if tp not in self.cluster.logs)
        if unknown:
            raise BrokerError(f"Kafka at {self.servers} has no partition {', '.join(f'{t}[{p}]' for t, p in unknown)}")

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        self._known(tps)
        return {tp: (self.cluster.start(tp), self.cluster.end(tp)) for tp in tps}

    def offsets_for_times(self, targets: Mapping[TP, datetime]) -> dict[TP, int | None]:
        self._known(targets)
        return offsets_for_times(self.cluster, targets)

    def committed(self, group: str) -> dict[TP, Committed]:
        return dict(self.cluster.committed.get(group, {}))

    def commit(self, group: str, offsets: Mapping[TP, int], metadata: str) -> None:
        with self.cluster.lock:
            live = self.cluster.groups.get(group)
            if live is not None and live.members:
                raise offsets_refused(self.servers, group, f"the group has {len(live.members)} live member(s)")
            self._known(offsets)
            committed = self.cluster.committed.setdefault(group, {})
            for tp, offset in offsets.items():
                committed[tp] = Committed(offset, metadata)

    def group_view(self, group: str) -> GroupView:
        found = self.cluster.groups.get(group)
        return GroupView((), False) if found is None else found.view()

    def last_values(self, tps: Sequence[TP], timeout_s: float) -> dict[TP, bytes | None]:
        with self.cluster.lock:
            self._known(tps)
            values: dict[TP, bytes | None] = {}
            for tp in tps:
                records = self.cluster.logs[tp].records
                values[tp] = records[-1].value if records else None
            return values

    def first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        found: dict[TP, int | None] = {}
        with self.cluster.lock:
            for tp, offset in offsets.items():
                log = self.cluster.logs.get(tp)
                if log is None or offset >= log.end:
                    continue  # nothing arrives in time
                ms = log.read(max(offset, log.start), 1)[0].timestamp_ms
                found[tp] = None if ms is None or ms < 0 else ms
        return found

    def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        return {t: self.cluster.partition_count(t) for t in topics}

    def create_missing(self, topics: Sequence[str], partitions: int | None, replication_factor: int | None,
                       config: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, int]]:
        with self.cluster.lock:
            created = [t for t in topics if not self.cluster.partition_count(t)]
            for t in created:
                self.cluster.create_topic(t, partitions or 1)
            return created, self.partition_counts(topics)

    def add_partitions(self, topic: str, total: int) -> None:
        have = self.cluster.partition_count(topic)
        if not have:
            raise BrokerError(f"Kafka at {self.servers} has no topic {topic!r}")
        if total < have:
            raise BrokerError(f"Kafka at {self.servers} refused to shrink topic {topic!r} from {have} to {total}")
        self.cluster.create_topic(topic, total)

    def close(self) -> None:
        pass
