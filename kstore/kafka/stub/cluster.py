"""The stub's brokers: :class:`Brokers` (topics, partition logs, committed offsets, consumer
groups), its groups (:class:`StubGroup`: members, generations, eager rebalances) and each member's
client-side state (:class:`StubMember`: the assignment, positions, pauses, the join step).

Invariants: a partition's log is append-only and its offsets are dense from its log start; a
group's partitions are each assigned to at most one member of its current generation; a member
the group expelled keeps its assignment, unaware, until its next join step.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kstore.kafka.seam import NO_POSITION, Committed, GroupMember, GroupView, Refused
from kstore.types import Message
from kstore.types import TopicPartition as TP


class Preemption(Protocol):
    """Where a test may run another thread's work while a member fetches: inside its fetch, after its
    join step (before the records are read: stage ``"before its fetch"``) and after the records are
    read (positions moved, records not yet returned: ``"after its fetch"``)."""

    def in_poll(self, consumer: StubMember, stage: str) -> None: ...


@dataclass
class _Log:
    """One partition: its records from the log start on."""

    records: list[Message] = field(default_factory=list)
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.records)

    def read(self, offset: int, n: int) -> list[Message]:
        return self.records[offset - self.start:offset - self.start + n]


class Brokers:
    """An in-memory Kafka: topics, partition logs, consumer groups and their committed offsets
    (the seam's peers on it are made by :class:`~kstore.kafka.stub.peer.StubCluster`).

    ``clock`` gives record timestamps (seconds, as :func:`time.time`); ``rng`` makes the group's and
    the fetches' choices (which member gets which partitions, how many records a fetch returns, in
    which order, whether an expelled member fetches once more before it hears): without one they
    are fixed (members in join order, every record a fetch may return, partitions in order, an
    expelled member hears at once). ``preemption`` is called inside each fetch (see :class:`Preemption`).
    ``blocking``: a fetch that finds nothing waits up to its timeout for a record or a change of its
    group, as a real client does (a worker's fetch thread would spin otherwise); a test that drives
    the worker's turns itself on a scripted clock (the simulation) passes False.

    Thread-safe: one lock guards the whole cluster (the listener calls run under it, so they must
    not wait for another thread that calls the stub).
    """

    def __init__(self, *, clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 blocking: bool = True) -> None:
        self.clock = clock
        self.rng = rng
        self.blocking = blocking
        self.lock = threading.RLock()
        #: Notified when a record is appended or a group's membership changes (what a blocked fetch waits for).
        self.changed = threading.Condition(self.lock)
        self.preemption: Preemption | None = None
        self.logs: dict[TP, _Log] = {}
        self.groups: dict[str, StubGroup] = {}
        #: Each group's committed offsets (the stub never reads them for a member: kstore never does).
        self.committed: dict[str, dict[TP, Committed]] = {}
        #: Each transactional id's producer epoch: a publisher made for a lane fences the one before.
        self.producer_epochs: dict[str, int] = {}
        self._members_made = 0

    # -- topics and logs ---------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> None:
        """Create ``name`` with ``partitions`` partitions, or add partitions up to that many."""
        with self.lock:
            for p in range(partitions):
                self.logs.setdefault((name, p), _Log())

    @property
    def partitions(self) -> list[TP]:
        return sorted(self.logs)

    def topics(self) -> set[str]:
        return {t for t, _ in self.logs}

    def partition_count(self, topic: str) -> int:
        return sum(1 for t, _ in self.logs if t == topic)

    def produce(self, topic: str, partition: int, value: bytes | None, key: bytes | None = None,
                headers: Sequence[tuple[str, bytes]] = (), timestamp_ms: int | None = None) -> int:
        """Append a record; returns its offset. The timestamp is the clock's unless given."""
        with self.lock:
            log = self.logs.get((topic, partition))
            if log is None:
                raise KeyError(f"no partition {topic}[{partition}] in the stub cluster")
            offset = log.end
            ms = int(self.clock() * 1000) if timestamp_ms is None else timestamp_ms
            log.records.append(Message(topic, partition, offset, key, value, tuple(headers), ms))
            self.changed.notify_all()
            return offset

    def delete_records(self, topic: str, partition: int, before: int) -> None:
        """Move the log start up to ``before`` (retention, ``kafka-delete-records``)."""
        with self.lock:
            log = self.logs[(topic, partition)]
            cut = max(0, min(before, log.end) - log.start)
            del log.records[:cut]
            log.start += cut

    def start(self, tp: TP) -> int:
        return self.logs[tp].start

    def end(self, tp: TP) -> int:
        return self.logs[tp].end

    def value(self, tp: TP, offset: int) -> bytes | None:
        value: bytes | None = self.logs[tp].read(offset, 1)[0].value
        return value

    def records(self, tp: TP) -> list[Message]:
        """The partition's records, from its log start."""
        with self.lock:
            return list(self.logs[tp].records)

    # -- groups ----------------------------------------------------------------------------------------

    def group(self, name: str) -> StubGroup:
        with self.lock:
            found = self.groups.get(name)
            if found is None:
                found = self.groups[name] = StubGroup(self, name)
            return found

    def new_member_id(self, client_id: str) -> str:
        self._members_made += 1
        return f"{client_id}-{self._members_made}"

    def expel(self, group: str, member_id: str) -> None:
        """A session timeout: the group forgets the member, which is not told (see :meth:`StubGroup.expel`)."""
        with self.lock:
            g = self.group(group)
            for member in list(g.members):
                if member.member_id == member_id:
                    g.expel(member)


@dataclass
class _PartitionState:
    #: Where the member fetches next; None until sought.
    position: int | None = None
    paused: bool = False
    #: Revoked in the rebalance under way: still assigned, no longer fetched.
    revoking: bool = False


class StubGroup:
    """A group coordinator: members, generations, eager rebalances.

    A rebalance starts when a member joins or leaves (or is expelled); every member must then take
    its join step (inside its fetch), which revokes everything it holds, before the group assigns
    the subscribed partitions among them, round robin, and moves to the next generation.
    """

    def __init__(self, cluster: Brokers, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.members: list[StubMember] = []
        self.generation = 0
        self.rebalancing = False
        self._joined: list[StubMember] = []

    # -- what the brokers see ------------------------------------------------------------------------

    def expel(self, member: StubMember) -> None:
        """Session timeout: forget the member without telling it (a zombie, or a dead process)."""
        with self.cluster.lock:
            if member in self.members:
                self.members.remove(member)
                member.pending = None
                self._membership_changed()

    def leave(self, member: StubMember) -> None:
        """LeaveGroup from a closing member."""
        self.expel(member)

    def view(self) -> GroupView:
        """The live members and their assignment as of the last generation; settled only with members
        and no rebalance under way (Kafka's ``Stable``: a group without members is ``Empty``)."""
        with self.cluster.lock:
            return GroupView(tuple(GroupMember(m.member_id, m.client_id, None, tuple(m.owned()))
                                   for m in self.members), bool(self.members) and not self.rebalancing)

    def _membership_changed(self) -> None:
        self.cluster.changed.notify_all()
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
        if self.cluster.rng is not None:
            self.cluster.rng.shuffle(members)
        shares: dict[int, list[TP]] = {id(m): [] for m in members}
        for i, tp in enumerate(self.cluster.partitions):
            eligible = [m for m in members if tp[0] in m.topics]
            if eligible:
                shares[id(eligible[i % len(eligible)])].append(tp)
        for m in members:
            m.pending = shares[id(m)]

    # -- a member's join step, inside its fetch ----------------------------------------------------

    def join_step(self, member: StubMember) -> None:
        if member not in self.members:
            if member.owned():
                member.lose_all()  # the group moved on without it
            member.member_id = self.cluster.new_member_id(member.client_id)
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


#: What a member tells its owner of a rebalance: ("assigned" | "revoked" | "lost", the partitions).
Listener = Callable[[str, list[TP]], None]


class StubMember:
    """One consumer's client-side state in its group: assignment, positions, pauses.

    It learns of the group's changes only in its join step (:meth:`join_step`: a fetch, or
    :meth:`io_step`, what a client's background thread may do meanwhile), and reports each change
    to its listener: a loss (expelled), a revoke (everything assigned, once per rebalance), an
    assignment (the whole new one, every partition paused and without a position until sought).
    """

    def __init__(self, cluster: Brokers, group: StubGroup, client_id: str, topics: Sequence[str]) -> None:
        self.cluster = cluster
        self.group = group
        self.client_id = client_id
        self.topics = list(topics)
        self.member_id = ""
        self.assignment: dict[TP, _PartitionState] = {}
        self.listener: Listener | None = None
        self.closed = False
        #: The assignment the group computed for this member, not yet picked up by a join step.
        self.pending: list[TP] | None = None
        #: Listener calls so far.
        self.callbacks = 0
        #: Each assigned partition's log end as of its last fetch.
        self.highwaters: dict[TP, int] = {}
        #: Whether a background thread of the client may take the join step (kafka-python's IO
        #: thread); False: only a fetch does (librdkafka runs the callbacks inside ``consume()``).
        self.background_join = True

    @property
    def name(self) -> str:
        return self.client_id

    @property
    def in_group(self) -> bool:
        return self in self.group.members

    # -- group membership (called by the group inside the join step) ----------------------------------

    def owned(self) -> list[TP]:
        return sorted(self.assignment)

    def lose_all(self) -> None:
        lost = self.owned()
        for tp in lost:
            self.assignment[tp].revoking = True
        self._call("lost", lost)
        self.assignment.clear()

    def revoke_all(self) -> None:
        """Eager: revoke everything assigned, once per join (a rejoin before the assignment came,
        because the rebalance started over, does not revoke again)."""
        revoked = [tp for tp in self.owned() if not self.assignment[tp].revoking]
        for tp in revoked:
            self.assignment[tp].revoking = True
        if revoked:
            self._call("revoked", revoked)

    def take_assignment(self) -> None:
        new, self.pending = self.pending or [], None
        # Every partition assigned, kept or new, is paused and has no position until sought, as the
        # real clients leave it (kstore's listener pauses and places each one before it is reported).
        self.assignment = {tp: _PartitionState(paused=True) for tp in sorted(new)}
        self._call("assigned", sorted(new))

    def _call(self, kind: str, tps: list[TP]) -> None:
        if self.listener is None:
            return
        self.callbacks += 1
        self.listener(kind, tps)

    # -- the client's side -------------------------------------------------------------------------------

    def unaware_of_expulsion(self) -> bool:
        """An expelled member learns it at a heartbeat: with an ``rng``, its first fetches after
        waking up may still read its old assignment (a zombie with fresh records) before its join step."""
        rng = self.cluster.rng
        return rng is not None and self not in self.group.members and bool(self.assignment) and rng.random() < 0.5

    def join_step(self) -> None:
        with self.cluster.lock:
            if self.topics and not self.closed:
                self.group.join_step(self)

    def io_step(self) -> bool:
        """What a client's background thread may do while the fetch thread is elsewhere: the join
        step and its listener calls, no records. True if the listener was called."""
        if not self.background_join:
            return False
        before = self.callbacks
        self.join_step()
        return self.callbacks != before

    def fetch(self, max_records: int) -> tuple[list[tuple[TP, list[Message]]], list[Refused]]:
        """Records from the position of each assigned, unpaused partition (moving it past them), and
        the partitions that cannot be read at their position."""
        out: list[tuple[TP, list[Message]]] = []
        refused: list[Refused] = []
        fetchable = [tp for tp, s in self.assignment.items() if not s.paused and not s.revoking]
        rng = self.cluster.rng
        if rng is not None:
            rng.shuffle(fetchable)
        budget = max_records
        for tp in fetchable:
            if budget <= 0:
                break
            state = self.assignment[tp]
            n = rng.randint(1, budget) if rng is not None else budget
            log = self.cluster.logs[tp]
            self.highwaters[tp] = log.end
            if state.position is None:
                refused.append(Refused(tp, NO_POSITION))
                state.paused = True
                continue
            if not log.start <= state.position <= log.end:  # no reset policy: the engine places it again
                refused.append(Refused(tp, state.position))
                state.paused = True
                continue
            records = log.read(state.position, n)
            if records:
                state.position += len(records)
                out.append((tp, records))
                budget -= len(records)
        for tp in [tp for tp in self.highwaters if tp not in self.assignment]:
            del self.highwaters[tp]
        return out, refused

    def close(self) -> None:
        """Leave the group: revoke what is held first; a member the group had expelled loses it."""
        with self.cluster.lock:
            if self.closed:
                return
            self.closed = True
            if self in self.group.members:
                self.revoke_all()
                self.group.leave(self)
            elif self.assignment:
                self.lose_all()
            self.assignment.clear()

    def describe(self) -> str:
        """Its assignment as the client sees it (for a test's failure report)."""
        parts = [f"{t}[{p}]@{s.position}" + (" paused" if s.paused else "") + (" revoking" if s.revoking else "")
                 for (t, p), s in sorted(self.assignment.items())]
        return f"{', '.join(parts) or 'nothing assigned'}; pending assignment {self.pending}"
