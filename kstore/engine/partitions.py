"""Every partition's state in one worker, in one object with one lock: :class:`Partitions`.

One :class:`PartitionState` per partition this worker knows of, with an explicit :class:`Status`:
**pending** (assigned by Kafka, to claim), **owned** (claimed and delivered: its epoch, its stored
offset, the queue of records fetched but not delivered, its generation, and where the next fetched
record must start), **held** (claimed, not delivered: paused until an operator moves it) or
**fenced** (claimed by another worker; remembered so that a partition Kafka still assigns here a
session timeout later is claimed again). A partition moves only by the transitions below, each
allowed from the statuses listed and refused (:class:`TransitionError`, a bug in kstore) from any
other:

========================  ===================================  =================================
transition                from                                 to
========================  ===================================  =================================
:meth:`assign`            (unknown), pending, fenced           pending
:meth:`own`               pending, owned, held                 owned (flushed, sought, resumed)
:meth:`place`             owned                                owned (under the same claim)
:meth:`hold`              pending, owned, held                 held (flushed, released)
:meth:`fence`             owned, held                          fenced (flushed, released)
:meth:`reclaim`           fenced a session timeout ago         pending if still assigned, else forgotten
:meth:`revoke`            any                                  forgotten (flushed, released)
========================  ===================================  =================================

(A fenced partition Kafka assigns here again before it is reclaimed goes to pending and keeps its
``fenced_at``, which :meth:`reclaim` then forgets without moving it.)

The ledger (:mod:`kstore.engine.ownership`) decides what to claim, adopt or drop; the batch loop
takes from the queues; the fetch thread fills them (the queues' side is the base class
:class:`_Queues`). All of it under :attr:`Partitions.lock`.
:attr:`~Partitions.owned`, :attr:`~Partitions.held`, :attr:`~Partitions.pending` and
:attr:`~Partitions.fenced_at` are read-only views of the one map. The client
(:class:`~kstore.kafka.seam.ConsumerSource`) holds none of this state: its callbacks only
:meth:`~Partitions.post` events here, and it seeks, pauses and resumes when told.

Invariants (kept by the transitions, asserted by :meth:`Partitions.check`, tested in
tests/unit/engine/test_partitions.py and test_partitions_state.py):

- **One status per partition.** Owned, held, pending and fenced are disjoint by construction: a
  partition has one state, and its state one status.
- **Owned <=> queued.** A partition has a queue exactly while it is owned: :meth:`own` makes it,
  every transition out of owned flushes and removes it. Records of a partition without a queue are
  dropped on arrival. Only an owned partition is noted unfetchable.
- **Generations are unique per worker.** Every flush (own, reset, disown) gives the queue a new
  generation from one counter that only grows. A batch remembers each partition's generation when
  taken, and goes back (:meth:`requeue`) only where it is unchanged: records fetched before a flush
  never reach a queue made after it, even a new queue for the same partition.
- **Which thread does what.** The fetch thread fetches without the lock, then queues what came
  (:meth:`queue_fetched`) and applies the events (:meth:`assign`, :meth:`revoke`) under it; the main
  thread takes batches, requeues them, claims, resets, holds and fences partitions under it. The lock
  is held across the client's local calls (seek, pause, resume), never across network I/O (a fetch,
  the brokers' answers, a database transaction of a claim). The views may be read without the lock
  (a snapshot of the map: never an error, possibly a moment old).
- **Callbacks never wait.** A client's rebalance callbacks run on a thread of the client's (kafka-python:
  its IO thread, while the main thread may hold the lock and wait inside a client call): :meth:`post`
  takes only the inbox's own lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from kstore.kafka.seam import NO_POSITION, ConsumerSource, EventKind, Fetched
from kstore.settings import Settings
from kstore.types import Record, timestamp_ms
from kstore.types import TopicPartition as TP

_V = TypeVar("_V")


@dataclass
class Owned:
    """A partition this worker delivers: the epoch it holds and the offset stored for it."""

    epoch: int
    committed: int


class Status(Enum):
    """Where a partition stands in this worker (see the module's docstring)."""

    #: Assigned by Kafka, not claimed yet: paused.
    PENDING = "pending"
    #: Claimed and delivered: fetched into its queue, taken by batches.
    OWNED = "owned"
    #: Claimed, not delivered (its stored offset lies past the log end): paused, waits for an operator.
    HELD = "held"
    #: Dropped because another worker claimed it; claimed again if Kafka still assigns it here a
    #: session timeout later (that claimer was a zombie).
    FENCED = "fenced"


class TransitionError(RuntimeError):
    """A partition was asked to move where its state machine does not go: a bug in kstore, never a
    user's error (the worker stops rather than deliver from a state it cannot account for)."""


@dataclass
class _Queue:
    """Records of one owned partition that kstore fetched but has not delivered yet."""

    records: deque[Any] = field(default_factory=deque)
    #: Offset the next fetched record must have at least; anything below is stale. Past the
    #: last queued record when the consumer skipped offsets with nothing to deliver there
    #: (transaction markers, records of aborted transactions): a batch that empties the queue
    #: commits up to here, so the stored offset reaches the log end.
    next_fetch: int = 0
    #: A new value from the counter on every flush (never reused, even by a new queue of the
    #: same partition): a batch taken under another generation is stale.
    generation: int = 0
    #: What ``size_of`` said of the queued records, less what was taken: their share of the
    #: queued bytes (a batch taking part of the queue takes its share by count).
    bytes: int = 0


@dataclass(eq=False)
class PartitionState:
    """One partition in this worker: its status and what that status carries. Changed only by
    :class:`Partitions`' transitions, under its lock."""

    status: Status
    #: Owned: the claim it is delivered under (its epoch, and the offset stored under it).
    owned: Owned | None = None
    #: Owned: the records fetched and not delivered.
    queue: _Queue | None = None
    #: Owned, and the client could not fetch from it: the offset it wanted and, if the log was
    #: truncated below it, what the client said. Paused until placed again.
    unfetchable: tuple[int, str | None] | None = None
    #: Held: the epoch claimed.
    held_epoch: int | None = None
    #: When another worker's claim was seen (fenced). Kept if Kafka assigns the partition here again
    #: without revoking it first, until :meth:`Partitions.reclaim` or a revoke forgets it.
    fenced_at: float | None = None


#: Which statuses each transition may start from (None: a partition this worker does not know).
_ALLOWED: dict[str, tuple[Status | None, ...]] = {
    "assign": (None, Status.PENDING, Status.FENCED),
    "own": (Status.PENDING, Status.OWNED, Status.HELD),
    "place": (Status.OWNED,),
    "hold": (Status.PENDING, Status.OWNED, Status.HELD),
    "fence": (Status.OWNED, Status.HELD),
}


def _copy(states: dict[TP, PartitionState]) -> dict[TP, PartitionState]:
    """The map as it is, for a reader without the lock. A dict's copy is made in one step of the
    interpreter (no other thread runs meanwhile), where iterating the dict itself, or even
    ``list(states.items())`` (its tuples may start a garbage collection, which may let another
    thread run), fails if another thread adds or removes a partition meanwhile."""
    return states.copy()


class _View(Mapping[TP, _V]):
    """A read-only view of the partitions whose state ``value`` gives a value for (None: not in it)."""

    __slots__ = ("_states", "_value")

    def __init__(self, states: dict[TP, PartitionState], value: Callable[[PartitionState], _V | None]) -> None:
        self._states = states
        self._value = value

    def __getitem__(self, tp: TP) -> _V:
        state = self._states.get(tp)
        found = None if state is None else self._value(state)
        if found is None:
            raise KeyError(tp)
        return found

    def __contains__(self, tp: object) -> bool:
        state = self._states.get(tp)  # type: ignore[call-overload]
        return state is not None and self._value(state) is not None

    def _snapshot(self) -> list[tuple[TP, _V]]:
        value = self._value
        return [(tp, v) for tp, state in _copy(self._states).items() if (v := value(state)) is not None]

    def __iter__(self) -> Iterator[TP]:
        return iter([tp for tp, _ in self._snapshot()])

    def __len__(self) -> int:
        return len(self._snapshot())

    def __bool__(self) -> bool:
        value = self._value
        return any(value(state) is not None for state in _copy(self._states).values())

    def __repr__(self) -> str:
        return repr(dict(self._snapshot()))


class _Members(Set[TP]):
    """A read-only view of the partitions in one status, as a set."""

    __slots__ = ("_states", "_status")

    def __init__(self, states: dict[TP, PartitionState], status: Status) -> None:
        self._states = states
        self._status = status

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> set[Any]:
        return set(it)  # what a set operation (``&``, ``|``, ``-``) on the view makes: a plain set

    def __contains__(self, tp: object) -> bool:
        state = self._states.get(tp)  # type: ignore[call-overload]
        return state is not None and state.status is self._status

    def __iter__(self) -> Iterator[TP]:
        status = self._status
        return iter([tp for tp, state in _copy(self._states).items() if state.status is status])

    def __len__(self) -> int:
        status = self._status
        return sum(1 for state in _copy(self._states).values() if state.status is status)

    def __bool__(self) -> bool:
        status = self._status
        return any(state.status is status for state in _copy(self._states).values())

    def __repr__(self) -> str:
        return repr(set(self))


class _Queues:
    """The records fetched for owned partitions and not delivered yet, and their accounting.

    The fetch thread queues what it fetched (:meth:`queue_fetched`), the batch loop takes batches
    (:meth:`take_batch`) and puts back what did not commit (:meth:`requeue`), and the throttle bounds
    their bytes. A partition's queue is its state's (:attr:`PartitionState.queue`): only the
    transitions of :class:`Partitions` make, flush and remove one.
    """

    def __init__(self, settings: Settings, source: ConsumerSource) -> None:
        self.settings = settings
        self.source = source
        self._size_of = source.size_of
        #: Held while any partition's state changes (see the invariants).
        self.lock = threading.RLock()
        #: Notified (under :attr:`lock`) when records were queued, taken, or the group changed.
        self.changed = threading.Condition(self.lock)
        #: Every partition this worker knows of. A partition that changes status moves to the end, so
        #: the owned ones come in the order they were delivered from (where take_batch's round starts).
        self._states: dict[TP, PartitionState] = {}
        self._generations = itertools.count(1)
        #: Where take_batch starts its round across the partitions (rotates).
        self._next_first = 0
        self._queued_records = 0
        self._queued_bytes = 0
        #: Fetching is paused for every owned partition while the queues hold too much.
        self._throttled = False

    # -- fetching (the fetch thread) --------------------------------------------------

    def generations(self) -> dict[TP, int]:
        """Each queue's generation now: taken before a fetch, handed to :meth:`queue_fetched` after it."""
        with self.lock:
            return {tp: q.generation for tp, s in self._states.items() if (q := s.queue) is not None}

    def queue_fetched(self, before: Mapping[TP, int], fetched: Fetched) -> int:
        """Queue what one fetch brought for partitions still owned under the generation ``before``
        held; returns how many records were queued. Records of a partition flushed while the fetch ran
        (reset, revoked, fenced) are dropped: they were fetched for a position that no longer holds."""
        queued = 0
        source = self.source
        states = self._states
        with self.lock:
            for tp, records in fetched.records:
                state = states.get(tp)
                q = None if state is None else state.queue
                if q is None:
                    continue  # not ours (any more); a claim will seek it before it is resumed
                if before.get(tp) != q.generation:
                    # Flushed and sought while the fetch ran. These records may come from before or
                    # after that seek, but the client's position moved past them either way: seek
                    # again, or records after the seek are lost.
                    source.seek(tp, q.next_fetch)
                    continue
                queued += self._enqueue(q, records)
            for refused in fetched.refused:
                self._refused(refused.tp, refused.offset, refused.truncated)
            self._note_skipped(before)
            if queued:
                self._throttle()
                self.changed.notify_all()
        return queued

    def _enqueue(self, q: _Queue, records: Sequence[Record]) -> int:
        if records[0].offset < q.next_fetch:
            # Stale: fetched before a seek backwards. Records come in offset order.
            records = [r for r in records if r.offset >= q.next_fetch]
            if not records:
                return 0
        q.records.extend(records)
        q.next_fetch = records[-1].offset + 1
        size = self._size_of(records)
        q.bytes += size
        self._queued_bytes += size
        self._queued_records += len(records)
        return len(records)

    def _refused(self, tp: TP, offset: int | None, truncated: str | None) -> None:
        """The client cannot fetch ``tp`` at ``offset`` (out of the log, or the log truncated below
        it): pause it, and note it for the worker if owned. Lock held."""
        source = self.source
        source.pause([tp])
        state = self._states.get(tp)
        q = None if state is None else state.queue
        if state is None or q is None:
            if offset == NO_POSITION:
                source.seek(tp, 0)  # a placeholder: paused, never fetched from; a claim seeks it
            return  # not delivered here: left paused until a claim places it
        if offset is not None and offset != q.next_fetch:
            # Not where kstore reads from (a seek overtook the fetch): read from there.
            source.seek(tp, q.next_fetch)
            if not self._throttled:
                source.resume([tp])
            return
        state.unfetchable = (q.next_fetch, truncated)

    def _note_skipped(self, before: Mapping[TP, int]) -> None:
        """After a fetch: where the client moved past the last queued record with nothing to
        return (transaction markers, records of aborted transactions), remember its position.

        Only forward moves of partitions not flushed during the fetch count: every record the
        client returned below its position has been queued (or dropped as stale, below
        ``next_fetch``), so nothing deliverable lies between ``next_fetch`` and the position.
        """
        queues = {tp: q for tp, s in self._states.items()
                  if (q := s.queue) is not None and before.get(tp) == q.generation}
        if not queues:
            return
        for tp, position in self.source.positions(list(queues)).items():
            q = queues.get(tp)
            if q is not None and position > q.next_fetch:
                q.next_fetch = position

    def _throttle(self) -> None:
        """Pause fetching while the queues hold ``max_buffered_bytes``; resume below half. Lock held.

        Memory is bounded by this setting, not by the topic's size, and the fetch thread keeps
        calling the client meanwhile, so the group membership stays alive.
        """
        limit = self.settings.max_buffered_bytes
        if not self._throttled and self._queued_bytes >= limit:
            self._throttled = True
            self.source.pause([tp for tp, s in self._states.items() if s.queue is not None])
        elif self._throttled and self._queued_bytes <= limit // 2:
            self._throttled = False
            self.source.resume([tp for tp, s in self._states.items()
                                if s.queue is not None and s.unfetchable is None])

    def room(self, limit: int, timeout_s: float) -> int:
        """How many records may be queued before ``limit`` is reached; waits up to
        ``timeout_s`` (for a batch to be taken) while there is no room."""
        with self.lock:
            if self._queued_records >= limit:
                self.changed.wait(timeout_s)
            return max(0, limit - self._queued_records)

    # -- delivering (the main thread) ---------------------------------------------------

    def queued(self) -> int:
        return self._queued_records

    def wake(self) -> None:
        """Wake a :meth:`wait` (the group changed, or the worker should look at its state)."""
        with self.lock:
            self.changed.notify_all()

    def wait(self, timeout_s: float, *, unless_queued: bool = True) -> None:
        """Wait until records are queued or :meth:`wake` is called, at most ``timeout_s``.

        ``unless_queued=False`` waits even while records are queued: a worker that
        may not process them yet (a retry's backoff) must sleep, not spin.
        """
        with self.lock:
            if not (unless_queued and self._queued_records):
                self.changed.wait(timeout_s)

    def wait_for(self, count: int, timeout_s: float) -> None:
        """Wait until ``count`` records are queued, at most ``timeout_s`` (the batch linger)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self._queued_records < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.changed.wait(remaining)

    def take_batch(self, max_records: int, only: TP | None = None
                   ) -> tuple[list[Record], dict[TP, int], dict[TP, int]]:
        """Up to ``max_records`` queued records, taken round-robin across partitions (or of
        partition ``only``); the offset after the last record taken of each partition; and how
        many were taken of each."""
        batch: list[Record] = []
        ends: dict[TP, int] = {}
        counts: dict[TP, int] = {}
        with self.lock:
            queues = [(tp, q) for tp, s in self._states.items()
                      if (q := s.queue) is not None and q.records and only in (None, tp)]
            if len(queues) > 1:
                # Start one partition further each time: with fewer records wanted than
                # partitions queued, the last ones would otherwise never be served.
                self._next_first = start = (self._next_first + 1) % len(queues)
                queues = queues[start:] + queues[:start]
            taken_bytes = 0
            while queues and len(batch) < max_records:
                share = max(1, (max_records - len(batch)) // len(queues))
                for tp, q in queues:
                    records = q.records
                    n = min(share, len(records), max_records - len(batch))
                    if n:
                        # The queue's bytes were summed once, when it was filled: a part taken
                        # takes its share by count (the whole, when it empties the queue).
                        whole = n == len(records)
                        part = q.bytes if whole else q.bytes * n // len(records)
                        q.bytes -= part
                        taken_bytes += part
                        if whole:
                            batch.extend(records)
                            records.clear()
                        else:
                            take = records.popleft
                            batch.extend([take() for _ in range(n)])
                        counts[tp] = counts.get(tp, 0) + n
                        # Emptied: up to where the consumer is (past any transaction marker).
                        ends[tp] = batch[-1].offset + 1 if records else max(batch[-1].offset + 1, q.next_fetch)
                queues = [(tp, q) for tp, q in queues if q.records]
            if batch:
                self._queued_records -= len(batch)
                self._queued_bytes -= taken_bytes
                if self._throttled:
                    self._throttle()
                self.changed.notify_all()  # room for the fetcher
        return batch, ends, counts

    def requeue(self, records: Sequence[Record], generations: Mapping[TP, int]) -> None:
        """Put records of an uncommitted batch back at the front of their queues.

        Same effect as seeking back to the batch's first offset (the client has already moved
        past them) without fetching them again. Partitions flushed since the batch was taken
        keep their new position.
        """
        size_of = self._size_of
        states = self._states
        with self.lock:
            # The queues still under the generation the batch was taken in, looked up once each.
            queues = {tp: q for tp, generation in generations.items()
                      if (s := states.get(tp)) is not None and (q := s.queue) is not None
                      and q.generation == generation}
            for record in reversed(records):
                q = queues.get((record.topic, record.partition))
                if q is not None:
                    q.records.appendleft(record)
                    self._queued_records += 1
                    size = size_of([record])
                    q.bytes += size
                    self._queued_bytes += size

    def has_records(self, tp: TP) -> bool:
        state = self._states.get(tp)
        q = None if state is None else state.queue
        return q is not None and bool(q.records)

    def generation(self, tp: TP) -> int | None:
        state = self._states.get(tp)
        q = None if state is None else state.queue
        return None if q is None else q.generation

    def queues(self) -> dict[TP, _Queue]:
        """Each owned partition's queue (for the tests' and the simulation's checks). Does not take
        the lock (a report of a failed schedule must not be a preemption point): hold it for a
        consistent answer."""
        return {tp: q for tp, s in _copy(self._states).items() if (q := s.queue) is not None}

    def heads(self) -> dict[TP, tuple[int | None, int | None]]:
        """For each owned partition: the last high watermark a fetch reported (None before the
        first) and the timestamp (ms) of the first queued record (None if none is queued).
        Local state only: no broker call."""
        with self.lock:
            return {tp: (self.source.highwater(tp), timestamp_ms(q.records[0]) if q.records else None)
                    for tp, s in self._states.items() if (q := s.queue) is not None}

    def buffered(self) -> tuple[int, int, bool]:
        """Records and bytes waiting in the queues, and whether fetching is paused for them."""
        return self._queued_records, self._queued_bytes, self._throttled

    def skipped(self, committed: Mapping[TP, int]) -> dict[TP, int]:
        """Owned partitions with nothing queued whose consumer moved past their ``committed``
        offset (transaction markers, aborted records only): ``{tp: offset to commit}``."""
        with self.lock:
            return {tp: q.next_fetch for tp, s in self._states.items()
                    if (q := s.queue) is not None and not q.records and tp in committed
                    and q.next_fetch > committed[tp]}

    def unfetchable(self) -> dict[TP, tuple[int, str | None]]:
        """Owned partitions the client could not fetch from: ``{tp: (offset, truncated)}``,
        paused until :meth:`own` places them again (or they stop being owned)."""
        with self.lock:
            return {tp: seen for tp, s in self._states.items() if (seen := s.unfetchable) is not None}

    def _flush(self, q: _Queue) -> None:
        self._queued_records -= len(q.records)
        self._queued_bytes -= q.bytes
        q.bytes = 0
        q.records.clear()
        q.generation = next(self._generations)



class Partitions(_Queues):
    """The one owner of a worker's per-partition state: each partition's status and its transitions
    (the queues' side is :class:`_Queues`'); see the module's docstring."""

    def __init__(self, settings: Settings, source: ConsumerSource) -> None:
        super().__init__(settings, source)
        #: Claimed and delivered: ``{tp: Owned(epoch, committed)}`` (a view).
        self.owned: Mapping[TP, Owned] = _View(self._states, _owned)
        #: Claimed but not delivered (stored offset past the log end): ``{tp: epoch}`` (a view).
        self.held: Mapping[TP, int] = _View(self._states, _held)
        #: Assigned by Kafka, not yet claimed (a view).
        self.pending: Set[TP] = _Members(self._states, Status.PENDING)
        #: Dropped because another worker claimed them, and when (a view). If Kafka still assigns one
        #: to this worker a session timeout later, that claimer was a zombie: claim it again.
        self.fenced_at: Mapping[TP, float] = _View(self._states, _fenced_at)
        self._inbox: list[tuple[EventKind, list[TP]]] = []
        self._inbox_lock = threading.Lock()  # the only lock a client's callback takes

    # -- rebalance events ------------------------------------------------------------

    def post(self, kind: EventKind, tps: Iterable[TP]) -> None:
        """A client's rebalance callback reports (any thread; never blocks on :attr:`lock`)."""
        with self._inbox_lock:
            self._inbox.append((kind, list(tps)))

    def take_events(self) -> list[tuple[EventKind, list[TP]]]:
        """Rebalance events since the last call, in the order they happened."""
        with self._inbox_lock:
            events, self._inbox = self._inbox, []
        return events

    def state(self, tp: TP) -> PartitionState | None:
        """The state of ``tp`` (None: not known here). Read it under :attr:`lock`; change it only
        by the transitions."""
        return self._states.get(tp)

    # -- transitions (lock held by the caller or taken here) ------------------------------

    def _move(self, tp: TP, transition: str, to: Status) -> PartitionState:
        """The state of ``tp``, moved to ``to`` if ``transition`` may start where it is (else raises
        TransitionError); moved to the end of the map when its status changes. Lock held."""
        state = self._states.get(tp)
        _check(tp, transition, state)
        if state is None:
            state = self._states[tp] = PartitionState(to)
        elif state.status is not to:
            del self._states[tp]
            self._states[tp] = state
            state.status = to
        return state

    def assign(self, tps: Iterable[TP]) -> None:
        """Kafka assigned ``tps`` to this worker: pending, to be claimed before any delivery."""
        with self.lock:
            tps = list(dict.fromkeys(tps))
            for tp in tps:  # all or nothing
                _check(tp, "assign", self._states.get(tp))
            for tp in tps:
                self._move(tp, "assign", Status.PENDING)

    def own(self, tp: TP, owned: Owned, offset: int) -> None:
        """Deliver ``tp`` from ``offset`` under ``owned`` (claimed, reset, or placed again): flush its
        queue, seek, resume."""
        with self.lock:
            state = self._move(tp, "own", Status.OWNED)
            state.held_epoch = None
            state.owned = owned
            q = state.queue
            if q is None:
                q = state.queue = _Queue()
            self._flush(q)
            state.unfetchable = None
            q.next_fetch = offset
            self.source.seek(tp, offset)
            if self._throttled:
                self._throttle()  # the flush may have made room: resume everything (this one included)
            if not self._throttled:
                self.source.resume([tp])

    def place(self, tp: TP, offset: int) -> None:
        """Fetch an owned partition again from ``offset`` (the client could not fetch it and the
        log holds the offset again): as :meth:`own`, under its current claim."""
        with self.lock:
            state = self._states.get(tp)
            _check(tp, "place", state)
            assert state is not None and state.owned is not None
            self.own(tp, state.owned, offset)

    def hold(self, tp: TP, epoch: int) -> None:
        """Claimed under ``epoch``, but not delivered (its stored offset lies past the log end): paused."""
        with self.lock:
            state = self._move(tp, "hold", Status.HELD)
            state.held_epoch = epoch
            self._undeliver([tp], [state])

    def fence(self, tps: Iterable[TP], at: float) -> list[TP]:
        """Another worker claimed ``tps`` (seen at monotonic time ``at``): stop delivering them and
        flush their queues; returns those that were delivered."""
        with self.lock:
            tps = list(dict.fromkeys(tps))
            for tp in tps:  # all or nothing
                _check(tp, "fence", self._states.get(tp))
            delivered = [tp for tp in tps if self._states[tp].status is Status.OWNED]
            states = [self._move(tp, "fence", Status.FENCED) for tp in tps]
            for state in states:
                state.held_epoch = None
                state.fenced_at = at
            self._undeliver(tps, states)
        return delivered

    def revoke(self, tps: Iterable[TP]) -> list[TP]:
        """Kafka took ``tps`` from this worker (revoked or lost), whatever their status: forget them
        and flush their queues; returns those that were delivered."""
        with self.lock:
            tps = list(tps)
            gone: list[PartitionState] = []
            delivered: list[TP] = []
            for tp in tps:
                state = self._states.pop(tp, None)
                if state is not None:
                    gone.append(state)
                    if state.status is Status.OWNED:
                        delivered.append(tp)
            self._undeliver(tps, gone)
        return delivered

    def reclaim(self, due: Iterable[TP], assigned: Collection[TP]) -> list[TP]:
        """Forget the fences of ``due`` (fenced a session timeout ago); those Kafka still ``assigned``
        here and nobody claimed since go back to pending, the others not assigned are forgotten.
        Returns the partitions to claim again. One revoked meanwhile is left as it is (gone)."""
        orphans: list[TP] = []
        with self.lock:
            for tp in due:
                state = self._states.get(tp)
                if state is None or state.fenced_at is None:
                    continue  # revoked meanwhile: nothing to claim
                state.fenced_at = None
                if state.status in (Status.FENCED, Status.PENDING) and tp in assigned:
                    orphans.append(tp)
                    self._move(tp, "assign", Status.PENDING)
                elif state.status is Status.FENCED:
                    del self._states[tp]  # no longer assigned here: nothing to remember
        return orphans

    def _undeliver(self, tps: list[TP], states: Iterable[PartitionState]) -> None:
        """Stop delivering: flush and remove the queues of ``states`` (those of ``tps`` that have one).
        The client releases ``tps``: nothing more is fetched of them (where Kafka still assigns them
        here) until a claim places them again. Lock held."""
        for state in states:
            q = state.queue
            if q is not None:
                self._flush(q)
            state.queue = state.owned = state.unfetchable = None
        if tps:
            self.source.release(tps)
        if self._throttled:
            # The flush may have freed enough: if nothing re-evaluated the bound, the
            # other partitions would stay paused with empty queues for good.
            self._throttle()

    def check(self) -> None:
        """Assert the invariants (tests and the simulation call it; cheap enough for them)."""
        with self.lock:
            for tp, s in self._states.items():
                owned = s.status is Status.OWNED
                assert owned == (s.owned is not None) == (s.queue is not None), (tp, s)
                assert (s.status is Status.HELD) == (s.held_epoch is not None), (tp, s)
                assert s.unfetchable is None or owned, (tp, s)
                assert s.status is not Status.FENCED or s.fenced_at is not None, (tp, s)
            queues = [s.queue for s in self._states.values() if s.queue is not None]
            assert self._queued_records == sum(len(q.records) for q in queues)
            assert self._queued_bytes == sum(q.bytes for q in queues)


def _check(tp: TP, transition: str, state: PartitionState | None) -> None:
    """Raise TransitionError unless ``transition`` may start from ``state``'s status."""
    status = None if state is None else state.status
    if status not in _ALLOWED[transition]:
        where = "unknown here" if status is None else status.value
        raise TransitionError(f"{tp[0]}[{tp[1]}]: cannot {transition} a partition that is {where}")


def _owned(state: PartitionState) -> Owned | None:
    return state.owned if state.status is Status.OWNED else None


def _held(state: PartitionState) -> int | None:
    return state.held_epoch if state.status is Status.HELD else None


def _fenced_at(state: PartitionState) -> float | None:
    return state.fenced_at
