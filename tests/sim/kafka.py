"""An in-memory Kafka: partition logs, one consumer group (eager rebalances), and a
consumer with the parts of kafka-python 3's ``KafkaConsumer`` that kstore uses.

Semantics copied from kafka-python 3.0 (read from its source, not its code):

- ``poll()`` first runs the group's pending join steps, calling the rebalance
  listener (``on_partitions_lost`` for a member the group expelled, then
  ``on_partitions_revoked`` for everything assigned, then, once every member has
  rejoined, ``on_partitions_assigned`` with the whole new assignment). Between the
  revoke and the new assignment the revoked partitions stay in ``assignment()``
  but are not fetched. A partition kept across a rebalance keeps its position
  and its paused flag.
- Then it returns records from the position of each assigned, unpaused
  partition, and moves the position past them. A new partition without a
  position starts at the log start (``auto_offset_reset='earliest'``); a position
  past the log end is reset to the log start too (offset out of range).
- ``seek`` raises ValueError, ``pause``/``resume`` raise KeyError, for a partition
  not assigned. Blocking calls (log bounds) raise RuntimeError inside a listener.
- The group only knows members that joined; an expelled member (session timeout)
  is not told: it learns at its next ``poll()`` (``on_partitions_lost``) and joins again.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kafka import TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import IllegalStateError
from kafka.structs import OffsetAndTimestamp

from .clock import SimClock

TP = tuple[str, int]


class _SortedSet(set[TopicPartition]):
    """A set (as kafka-python hands the listener) that iterates in order, so that a seed
    replays the same run whatever ``PYTHONHASHSEED`` is."""

    def __iter__(self) -> Iterator[TopicPartition]:
        return iter(sorted(set.__iter__(self)))


class Cluster:
    """The brokers: one log per partition."""

    def __init__(self, clock: SimClock, partitions: dict[str, int]) -> None:
        self.clock = clock
        self.logs: dict[TP, list[Any]] = {(t, p): [] for t, n in partitions.items() for p in range(n)}

    @property
    def partitions(self) -> list[TP]:
        return sorted(self.logs)

    def produce(self, tp: TP, value: bytes, key: bytes | None = None) -> int:
        log = self.logs[tp]
        offset = len(log)
        headers = [("sim", b"1")]
        log.append(ConsumerRecord(tp[0], tp[1], 0, offset, self.clock.ms(), 0, key, value, headers, None,
                                  -1 if key is None else len(key), len(value), 4))
        return offset

    def start(self, tp: TP) -> int:
        return 0

    def end(self, tp: TP) -> int:
        return len(self.logs[tp])

    def value(self, tp: TP, offset: int) -> bytes:
        return bytes(self.logs[tp][offset].value)


class Preemption(Protocol):
    """Where the simulation may run another thread's work: inside ``poll()``, after its join step
    (before the records are fetched) and after the fetch (positions moved, records not yet returned)."""

    def in_poll(self, consumer: SimConsumer, stage: str) -> None: ...


@dataclass
class _PartitionState:
    position: int | None = None
    paused: bool = False
    revoking: bool = False


class Group:
    """The group coordinator: members, generations, eager rebalances."""

    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self.members: list[SimConsumer] = []
        self.generation = 0
        self.rebalancing = False
        self._joined: list[SimConsumer] = []

    # -- what the brokers see ------------------------------------------------

    def expel(self, member: SimConsumer) -> None:
        """Session timeout: forget the member without telling it (a zombie, or a dead process)."""
        if member in self.members:
            self.members.remove(member)
            member.pending = None
            self._membership_changed()

    def leave(self, member: SimConsumer) -> None:
        """LeaveGroup from a closing member."""
        self.expel(member)

    def _membership_changed(self) -> None:
        if self.rebalancing:
            self._joined = [m for m in self._joined if m in self.members]
            self._maybe_complete()
        elif self.members:
            self._start_rebalance()

    def _start_rebalance(self) -> None:
        self.rebalancing = True
        self._joined = []
        for m in self.members:
            m.pending = None

    def _maybe_complete(self) -> None:
        if not self.rebalancing or any(m not in self._joined for m in self.members):
            return
        self.rebalancing = False
        self.generation += 1
        members = list(self.members)
        self.rng.shuffle(members)
        shares: dict[int, list[TopicPartition]] = {id(m): [] for m in members}
        for i, tp in enumerate(self.cluster.partitions):
            if members:
                shares[id(members[i % len(members)])].append(TopicPartition(*tp))
        for m in members:
            m.pending = shares[id(m)]

    # -- a member's join step, inside its poll() --------------------------------

    def join_step(self, member: SimConsumer) -> None:
        if member not in self.members:
            if member.owned():
                member.lose_all()  # the group moved on without it
            self.members.append(member)
            self._membership_changed()
        if member.pending is not None:
            member.take_assignment()
        if self.rebalancing and member not in self._joined:
            member.revoke_all()
            self._joined.append(member)
            self._maybe_complete()
            if member.pending is not None:
                member.take_assignment()


class SimConsumer:
    """kafka-python 3's ``KafkaConsumer``, as far as kstore uses it."""

    def __init__(self, name: str, cluster: Cluster, group: Group, rng: random.Random,
                 preemption: Preemption | None = None) -> None:
        self.name = name
        self.cluster = cluster
        self.group = group
        self.rng = rng
        self.preemption = preemption
        self._assignment: dict[TopicPartition, _PartitionState] = {}
        self._listener: Any = None
        self._topics: list[str] = []
        self._closed = False
        self._in_listener = False
        #: The assignment the group computed for this member, not yet picked up by a poll().
        self.pending: list[TopicPartition] | None = None
        #: Listener calls so far.
        self.callbacks = 0

    # -- group membership (called by Group inside poll) ---------------------------

    def owned(self) -> list[TopicPartition]:
        return sorted(self._assignment)

    def lose_all(self) -> None:
        lost = self.owned()
        for tp in lost:
            self._assignment[tp].revoking = True
        self._call("on_partitions_lost", lost)
        self._assignment.clear()

    def revoke_all(self) -> None:
        """Eager: revoke everything assigned, once per join (a rejoin before the assignment came,
        because the rebalance started over, does not revoke again)."""
        revoked = [tp for tp in self.owned() if not self._assignment[tp].revoking]
        for tp in revoked:
            self._assignment[tp].revoking = True
        if revoked:
            self._call("on_partitions_revoked", revoked)

    def take_assignment(self) -> None:
        new, self.pending = self.pending or [], None
        kept = {tp: state for tp, state in self._assignment.items() if tp in new}
        for state in kept.values():
            state.revoking = False
        self._assignment = {tp: kept.get(tp) or _PartitionState() for tp in sorted(new)}
        self._call("on_partitions_assigned", sorted(new))

    def _call(self, method: str, tps: list[TopicPartition]) -> None:
        if self._listener is None:
            return
        self.callbacks += 1
        self._in_listener = True
        try:
            getattr(self._listener, method)(_SortedSet(tps))
        finally:
            self._in_listener = False

    # -- the KafkaConsumer API ----------------------------------------------------

    def subscribe(self, topics: Sequence[str] = (), pattern: Any = None, listener: Any = None) -> None:
        self._topics = list(topics)
        self._listener = listener

    def poll(self, timeout_ms: int = 0, max_records: int | None = None, update_offsets: bool = True
             ) -> dict[TopicPartition, list[Any]]:
        if timeout_ms < 0:
            raise ValueError("Timeout must not be negative")
        if max_records is not None and max_records <= 0:
            raise ValueError("max_records must be positive")
        if self._closed:
            raise IllegalStateError("KafkaConsumer is closed")
        if self._topics and not self._unaware_of_expulsion():
            self.group.join_step(self)
        if self.preemption is not None:
            self.preemption.in_poll(self, "before its fetch")
        records = self._fetch(max_records or 500)
        if self.preemption is not None:  # positions already moved past the records returned
            self.preemption.in_poll(self, "after its fetch")
        return records

    def _unaware_of_expulsion(self) -> bool:
        """An expelled member learns it at a heartbeat: its first polls after waking up may still
        fetch for its old assignment (a zombie with fresh records) before its join step."""
        return self not in self.group.members and bool(self._assignment) and self.rng.random() < 0.5

    def io_step(self) -> bool:
        """What kafka-python's IO thread may do while the polling thread is inside poll():
        the join step and its listener calls, no records. True if the listener was called."""
        before = self.callbacks
        if self._topics and not self._closed:
            self.group.join_step(self)
        return self.callbacks != before

    def _fetch(self, max_records: int) -> dict[TopicPartition, list[Any]]:
        out: dict[TopicPartition, list[Any]] = {}
        fetchable = [tp for tp, s in self._assignment.items() if not s.paused and not s.revoking]
        self.rng.shuffle(fetchable)
        budget = max_records
        for tp in fetchable:
            if budget <= 0:
                break
            records = self._read(tp, self.rng.randint(1, budget))
            if records:
                out[tp] = records
                budget -= len(records)
        return out

    def _read(self, tp: TopicPartition, n: int) -> list[Any]:
        state = self._assignment[tp]
        key = (tp.topic, tp.partition)
        start, end = self.cluster.start(key), self.cluster.end(key)
        if state.position is None or state.position > end:
            state.position = start  # auto_offset_reset='earliest' (also on offset out of range)
        records = self.cluster.logs[key][state.position:state.position + n]
        state.position += len(records)
        return records

    def _state(self, tp: Any) -> _PartitionState:
        if not isinstance(tp, TopicPartition):
            raise TypeError("partitions must be TopicPartition namedtuples")
        return self._assignment[tp]  # KeyError for a partition not assigned, like kafka-python 3

    def pause(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            self._state(tp).paused = True

    def resume(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            self._state(tp).paused = False

    def paused(self) -> set[TopicPartition]:
        return {tp for tp, s in self._assignment.items() if s.paused}

    def seek(self, partition: TopicPartition, offset: int) -> None:
        if not isinstance(partition, TopicPartition):
            raise TypeError("partition must be a TopicPartition namedtuple")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError("Offset must be int >= 0")
        if partition not in self._assignment:
            raise ValueError("Unassigned partition")
        self._assignment[partition].position = offset

    def position(self, partition: TopicPartition) -> int | None:
        self._blocking()
        if partition not in self._assignment:
            raise IllegalStateError("Partition is not assigned")
        return self._assignment[partition].position

    def assignment(self) -> set[TopicPartition]:
        return set(self._assignment)

    def _blocking(self) -> None:
        if self._in_listener:
            raise RuntimeError("Cannot block on net.run() from the IO thread itself")

    def beginning_offsets(self, partitions: Iterable[TopicPartition], timeout_ms: int | None = None
                          ) -> dict[TopicPartition, int]:
        self._blocking()
        return {tp: self.cluster.start((tp.topic, tp.partition)) for tp in partitions}

    def end_offsets(self, partitions: Iterable[TopicPartition], timeout_ms: int | None = None
                    ) -> dict[TopicPartition, int]:
        self._blocking()
        return {tp: self.cluster.end((tp.topic, tp.partition)) for tp in partitions}

    def offsets_for_times(self, timestamps: dict[TopicPartition, int], timeout_ms: int | None = None
                          ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        self._blocking()
        out: dict[TopicPartition, OffsetAndTimestamp | None] = {}
        for tp, ms in timestamps.items():
            found = [r for r in self.cluster.logs[(tp.topic, tp.partition)] if r.timestamp >= ms]
            out[tp] = OffsetAndTimestamp(found[0].offset, found[0].timestamp, 0) if found else None
        return out

    def topics(self) -> set[str]:
        self._blocking()
        return {t for t, _ in self.cluster.logs}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {p for t, p in self.cluster.logs if t == topic}

    def close(self, autocommit: bool = True, timeout_ms: int | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if self in self.group.members:
            self.revoke_all()
            self.group.leave(self)
        elif self._assignment:
            self.lose_all()
        self._assignment.clear()

    @property
    def closed(self) -> bool:
        return self._closed
