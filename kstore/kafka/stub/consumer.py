"""The worker's consumer on the stub cluster: :class:`StubSource`, a :class:`~kstore.kafka.seam.ConsumerSource`.

It posts the rebalance events the real clients post, from the member's join step (inside
:meth:`StubSource.fetch`, or :meth:`~.cluster.StubMember.io_step` when a test plays a client's
background thread), as kafka-python's listener does: every partition given is paused, without a
position, before it is reported; a revoke names everything held (eager); an expelled member hears
of it at its next join step (``lost``). The engine's seek, pause and resume act at once and skip
a partition no longer assigned (its event follows), as both real clients do at the seam.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.seam import MIRROR_METADATA, RECORD_OVERHEAD, Committed, EventKind, Fetched, GroupView, OnRebalance
from kstore.types import TopicPartition as TP

from .cluster import Brokers, StubMember

if TYPE_CHECKING:
    from kstore.settings import Settings

#: How many records a fetch returns at most when the engine does not say.
DEFAULT_MAX_RECORDS = 500


def records_size(records: Sequence[Any]) -> int:
    """Approximate memory of queued stub records: :data:`RECORD_OVERHEAD` each and the bytes of its key and value."""
    return sum(RECORD_OVERHEAD + len(r.key or b"") + len(r.value or b"") for r in records)


class StubSource:
    """The worker's consumer on a :class:`~.peer.StubCluster` (see the module's docstring)."""

    queues_messages: ClassVar[bool] = True
    describes_group: ClassVar[bool] = True
    #: As kafka-python's: a rebalance may reach the engine from a thread other than the fetch
    #: thread (a test's :meth:`~.cluster.StubMember.io_step`), so the engine queues it.
    callbacks_may_lock: ClassVar[bool] = False

    @staticmethod
    def size_of(records: Sequence[Any]) -> int:
        return records_size(records)

    def __init__(self, cluster: Brokers, settings: Settings, group: str, topics: Sequence[str],
                 worker_id: str) -> None:
        self.cluster = cluster
        self.settings = settings
        self.group = group
        self.topics = list(topics)
        self.worker_id = worker_id
        self.joins = 0
        self.member_id: str | None = None
        #: The member's state in its group, as a client library holds it.
        self.consumer = StubMember(cluster, cluster.group(group), settings.client_id or worker_id, ())
        self._post: OnRebalance | None = None
        self._mirror: dict[TP, int] = {}

    def check_topics(self) -> None:
        missing = [t for t in self.topics if t not in self.cluster.topics()]
        if missing:
            raise ConfigurationError(
                f"unknown topic(s) {', '.join(missing)} at {self.settings.bootstrap_servers}: create them first")

    def subscribe(self, on_rebalance: OnRebalance) -> None:
        """Join the group at the next fetch."""
        self._post = on_rebalance
        self.consumer.topics = list(self.topics)
        self.consumer.listener = self._on_event

    def _on_event(self, kind: str, tps: list[TP]) -> None:
        if kind == "assigned":
            self.joins += 1
            self.member_id = self.consumer.member_id or None
        if self._post is not None:
            self._post(cast(EventKind, kind), tps)

    def fetch(self, timeout_ms: int, max_records: int) -> Fetched:
        """The join step (unless an expelled member has not heard yet), then records; never waits."""
        member, cluster = self.consumer, self.cluster
        with cluster.lock:
            if member.closed:
                raise BrokerError("the stub consumer is closed")
            self._before_join()
            if not member.unaware_of_expulsion():
                member.join_step()
        preemption = cluster.preemption
        if preemption is not None:
            preemption.in_poll(member, "before its fetch")
        with cluster.lock:
            records, refused = member.fetch(max_records or DEFAULT_MAX_RECORDS)
            if not records and not refused and cluster.blocking and timeout_ms > 0:
                cluster.changed.wait(timeout_ms / 1000)
                records, refused = member.fetch(max_records or DEFAULT_MAX_RECORDS)
        if preemption is not None:  # positions already moved past the records returned
            preemption.in_poll(member, "after its fetch")
        return Fetched(records, refused)

    def _before_join(self) -> None:
        """What the fetch does first, lock held (see :class:`DeferringStubSource`)."""

    def positions(self, tps: Sequence[TP]) -> dict[TP, int]:
        found: dict[TP, int] = {}
        with self.cluster.lock:
            for tp in tps:
                state = self.consumer.assignment.get(tp)
                if state is not None and state.position is not None:
                    found[tp] = state.position
        return found

    def seek(self, tp: TP, offset: int) -> None:
        with self.cluster.lock:
            state = self.consumer.assignment.get(tp)
            if state is not None:
                state.position = offset

    def pause(self, tps: Sequence[TP]) -> None:
        self._set_paused(tps, True)

    def resume(self, tps: Sequence[TP]) -> None:
        self._set_paused(tps, False)

    def release(self, tps: Sequence[TP]) -> None:
        self.pause(tps)

    def _set_paused(self, tps: Sequence[TP], paused: bool) -> None:
        with self.cluster.lock:
            for tp in tps:
                state = self.consumer.assignment.get(tp)
                if state is not None:
                    state.paused = paused

    def assignment(self) -> set[TP]:
        with self.cluster.lock:
            return set(self.consumer.assignment)

    def highwater(self, tp: TP) -> int | None:
        return self.consumer.highwaters.get(tp)

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        with self.cluster.lock:
            unknown = [tp for tp in tps if tp not in self.cluster.logs]
            if unknown:
                raise BrokerError(f"cannot read the log bounds of {len(tps)} partition(s): unknown {unknown}")
            return {tp: (self.cluster.start(tp), self.cluster.end(tp)) for tp in tps}

    def offsets_for_times(self, targets: dict[TP, datetime]) -> dict[TP, int | None]:
        return offsets_for_times(self.cluster, targets)

    def group_stable(self) -> bool:
        member = self.consumer
        with self.cluster.lock:
            return member.in_group and not member.group.rebalancing and member.pending is None

    def group_members(self) -> GroupView:
        return self.consumer.group.view()

    def mirror(self, offsets: Mapping[TP, int]) -> None:
        with self.cluster.lock:
            self._mirror.update(offsets)

    def flush_mirror(self) -> None:
        with self.cluster.lock:
            offsets, self._mirror = self._mirror, {}
            committed = self.cluster.committed.setdefault(self.group, {})
            for tp, offset in offsets.items():
                if tp in self.consumer.assignment:
                    committed[tp] = Committed(offset, MIRROR_METADATA)

    def close(self) -> None:
        self.consumer.close()


class DeferringStubSource(StubSource):
    """The stub's consumer with confluent-kafka's threading: the rebalance callbacks run only inside
    :meth:`fetch`, on the fetch thread, so the engine applies a revoke there and then
    (``callbacks_may_lock``); the engine's seek, pause, resume and release are wishes that the next
    fetch carries out first, for the partitions still assigned then (the last wish for a partition
    wins); a revoke takes the partitions out of :meth:`assignment` at once (eager ``unassign()``)."""

    callbacks_may_lock: ClassVar[bool] = True

    def __init__(self, cluster: Brokers, settings: Settings, group: str, topics: Sequence[str],
                 worker_id: str) -> None:
        super().__init__(cluster, settings, group, topics, worker_id)
        self.consumer.background_join = False
        self._want_seek: dict[TP, int] = {}
        self._want_paused: dict[TP, bool] = {}

    def seek(self, tp: TP, offset: int) -> None:
        with self.cluster.lock:
            self._want_seek[tp] = offset

    def _set_paused(self, tps: Sequence[TP], paused: bool) -> None:
        with self.cluster.lock:
            self._want_paused.update(dict.fromkeys(tps, paused))

    def release(self, tps: Sequence[TP]) -> None:
        """A seek or resume wished before the partitions were dropped must not start them again
        before their next claim: forget those, and pause them."""
        with self.cluster.lock:
            for tp in tps:
                self._want_seek.pop(tp, None)
            self._want_paused.update(dict.fromkeys(tps, True))

    def _before_join(self) -> None:
        seeks, self._want_seek = self._want_seek, {}
        wanted, self._want_paused = self._want_paused, {}
        assigned = self.assignment()
        for tp, offset in seeks.items():
            if tp in assigned:
                super().seek(tp, offset)
        for tp, paused in wanted.items():
            if tp in assigned:
                super()._set_paused([tp], paused)

    def assignment(self) -> set[TP]:
        with self.cluster.lock:
            return {tp for tp, state in self.consumer.assignment.items() if not state.revoking}


def offsets_for_times(cluster: Brokers, targets: Mapping[TP, datetime]) -> dict[TP, int | None]:
    """The first offset of each partition whose record is at or after its time (None: none that late)."""
    found: dict[TP, int | None] = {}
    for tp, when in targets.items():
        ms = int(when.timestamp() * 1000)
        found[tp] = next((r.offset for r in cluster.records(tp) if (r.timestamp_ms or -1) >= ms), None)
    return found
