"""Every partition's state in one worker, in one object with one lock: :class:`Partitions`.

Which partitions the worker owns (at which epoch and stored offset), holds, must claim, or saw
fenced; and, for each owned one, the queue of records fetched but not delivered, its generation,
and where the next fetched record must start. The ledger (:mod:`kstore.engine.ownership`) decides
what to claim, adopt or drop; the batch loop takes from the queues; the fetch thread fills them.
All of it under :attr:`Partitions.lock`. The client (:class:`~kstore.kafka.seam.ConsumerSource`)
holds none of this state: its callbacks only :meth:`~Partitions.post` events here, and it seeks,
pauses and resumes when told.

Invariants (stated here, kept here, tested in tests/unit/engine/test_partitions.py):

- **Owned <=> queued.** A partition has a queue exactly while it is in :attr:`owned`:
  :meth:`own` makes both, :meth:`disown` removes both. Records of a partition without a queue are
  dropped on arrival.
- ``owned``, ``held`` and ``pending`` are disjoint.
- **Generations are unique per worker.** Every flush (own, reset, disown) gives the queue a new
  generation from one counter that only grows. A batch remembers each partition's generation when
  taken, and goes back (:meth:`requeue`) only where it is unchanged: records fetched before a flush
  never reach a queue made after it, even a new queue for the same partition.
- **Which thread does what.** The fetch thread fetches without the lock, then queues what came
  (:meth:`queue_fetched`) and applies the events (the worker's ``_apply_events``) under it; the main
  thread takes batches, requeues them, claims, resets and drops partitions under it. The lock is held
  across the client's local calls (seek, pause, resume), never across network I/O (a fetch, the
  brokers' answers, a database transaction of a claim).
- **Callbacks never wait.** A client's rebalance callbacks run on a thread of the client's (kafka-python:
  its IO thread, while the main thread may hold the lock and wait inside a client call): :meth:`post`
  takes only the inbox's own lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kstore.kafka.seam import NO_POSITION, ConsumerSource, EventKind, Fetched
from kstore.settings import Settings
from kstore.types import Record, timestamp_ms
from kstore.types import TopicPartition as TP


@dataclass
class Owned:
    """A partition this worker delivers: the epoch it holds and the offset stored for it."""

    epoch: int
    committed: int


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


class Partitions:
    """The one owner of a worker's per-partition state; see the module's docstring."""

    def __init__(self, settings: Settings, source: ConsumerSource) -> None:
        self.settings = settings
        self.source = source
        self._size_of = source.size_of
        #: Held while any partition's state changes (see the invariants).
        self.lock = threading.RLock()
        #: Notified (under :attr:`lock`) when records were queued, taken, or the group changed.
        self.changed = threading.Condition(self.lock)
        self.owned: dict[TP, Owned] = {}
        #: Claimed but not delivered: stored offset past the log end; waits for an operator.
        self.held: dict[TP, int] = {}
        #: Assigned by Kafka, not yet claimed.
        self.pending: set[TP] = set()
        #: Dropped because another worker claimed them, and when. If Kafka still assigns one
        #: to this worker a session timeout later, that claimer was a zombie: claim it again.
        self.fenced_at: dict[TP, float] = {}
        self._queues: dict[TP, _Queue] = {}
        self._generations = itertools.count(1)
        #: Where take_batch starts its round across the partitions (rotates).
        self._next_first = 0
        self._queued_records = 0
        self._queued_bytes = 0
        #: Fetching is paused for every owned partition while the queues hold too much.
        self._throttled = False
        #: Owned partitions the client could not fetch from, paused: the offset it wanted and,
        #: if the log was truncated below it, what it said (the worker places them again).
        self._unfetchable: dict[TP, tuple[int, str | None]] = {}
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

    # -- fetching (the fetch thread) --------------------------------------------------

    def generations(self) -> dict[TP, int]:
        """Each queue's generation now: taken before a fetch, handed to :meth:`queue_fetched` after it."""
        with self.lock:
            return {tp: q.generation for tp, q in self._queues.items()}

    def queue_fetched(self, before: Mapping[TP, int], fetched: Fetched) -> int:
        """Queue what one fetch brought for partitions still owned under the generation ``before``
        held; returns how many records were queued. Records of a partition flushed while the fetch ran
        (reset, revoked, fenced) are dropped: they were fetched for a position that no longer holds."""
        queued = 0
        source = self.source
        with self.lock:
            for tp, records in fetched.records:
                q = self._queues.get(tp)
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
        q = self._queues.get(tp)
        if q is None:
            if offset == NO_POSITION:
                source.seek(tp, 0)  # a placeholder: paused, never fetched from; a claim seeks it
            return  # not delivered here: left paused until a claim places it
        if offset is not None and offset != q.next_fetch:
            # Not where kstore reads from (a seek overtook the fetch): read from there.
            source.seek(tp, q.next_fetch)
            if not self._throttled:
                source.resume([tp])
            return
        self._unfetchable[tp] = (q.next_fetch, truncated)

    def _note_skipped(self, before: Mapping[TP, int]) -> None:
        """After a fetch: where the client moved past the last queued record with nothing to
        return (transaction markers, records of aborted transactions), remember its position.

        Only forward moves of partitions not flushed during the fetch count: every record the
        client returned below its position has been queued (or dropped as stale, below
        ``next_fetch``), so nothing deliverable lies between ``next_fetch`` and the position.
        """
        tps = [tp for tp, q in self._queues.items() if before.get(tp) == q.generation]
        if not tps:
            return
        for tp, position in self.source.positions(tps).items():
            q = self._queues.get(tp)
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
            self.source.pause(list(self._queues))
        elif self._throttled and self._queued_bytes <= limit // 2:
            self._throttled = False
            self.source.resume([tp for tp in self._queues if tp not in self._unfetchable])

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
            queues = [(tp, q) for tp, q in self._queues.items() if q.records and only in (None, tp)]
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
        with self.lock:
            for record in reversed(records):
                tp = (record.topic, record.partition)
                q = self._queues.get(tp)
                if q is not None and q.generation == generations.get(tp):
                    q.records.appendleft(record)
                    self._queued_records += 1
                    size = size_of([record])
                    q.bytes += size
                    self._queued_bytes += size

    def has_records(self, tp: TP) -> bool:
        q = self._queues.get(tp)
        return q is not None and bool(q.records)

    def generation(self, tp: TP) -> int | None:
        q = self._queues.get(tp)
        return None if q is None else q.generation

    def heads(self) -> dict[TP, tuple[int | None, int | None]]:
        """For each owned partition: the last high watermark a fetch reported (None before the
        first) and the timestamp (ms) of the first queued record (None if none is queued).
        Local state only: no broker call."""
        with self.lock:
            return {tp: (self.source.highwater(tp), timestamp_ms(q.records[0]) if q.records else None)
                    for tp, q in self._queues.items()}

    def buffered(self) -> tuple[int, int, bool]:
        """Records and bytes waiting in the queues, and whether fetching is paused for them."""
        return self._queued_records, self._queued_bytes, self._throttled

    def skipped(self, committed: Mapping[TP, int]) -> dict[TP, int]:
        """Owned partitions with nothing queued whose consumer moved past their ``committed``
        offset (transaction markers, aborted records only): ``{tp: offset to commit}``."""
        with self.lock:
            return {tp: q.next_fetch for tp, q in self._queues.items()
                    if not q.records and tp in committed and q.next_fetch > committed[tp]}

    def unfetchable(self) -> dict[TP, tuple[int, str | None]]:
        """Owned partitions the client could not fetch from: ``{tp: (offset, truncated)}``,
        paused until :meth:`own` places them again (or they are disowned)."""
        with self.lock:
            return dict(self._unfetchable)

    # -- ownership and position (lock held by the caller or taken here) -----------------

    def own(self, tp: TP, owned: Owned, offset: int) -> None:
        """Deliver ``tp`` from ``offset`` under ``owned``: flush its queue, seek, resume."""
        with self.lock:
            self.held.pop(tp, None)
            self.pending.discard(tp)
            self.owned[tp] = owned
            q = self._queues.setdefault(tp, _Queue())
            self._flush(q)
            self._unfetchable.pop(tp, None)
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
            self.own(tp, self.owned[tp], offset)

    def hold(self, tp: TP, epoch: int) -> None:
        """Claimed, but not delivered (its stored offset lies past the log end): paused."""
        with self.lock:
            self.owned.pop(tp, None)
            self.pending.discard(tp)
            self.held[tp] = epoch
            self.disown([tp])

    def disown(self, tps: Iterable[TP]) -> None:
        """Stop delivering ``tps`` and flush their queues (revoked, lost, held or fenced). The client
        releases them: nothing more is fetched of them (where Kafka still assigns them here) until a
        claim places them again."""
        with self.lock:
            tps = list(tps)
            for tp in tps:
                self.owned.pop(tp, None)
                q = self._queues.pop(tp, None)
                self._unfetchable.pop(tp, None)
                if q is not None:
                    self._flush(q)
            if tps:
                self.source.release(tps)
            if self._throttled:
                # The flush may have freed enough: if nothing re-evaluated the bound, the
                # other partitions would stay paused with empty queues for good.
                self._throttle()

    def _flush(self, q: _Queue) -> None:
        self._queued_records -= len(q.records)
        self._queued_bytes -= q.bytes
        q.bytes = 0
        q.records.clear()
        q.generation = next(self._generations)

    def check(self) -> None:
        """Assert the invariants (tests and the simulation call it; cheap enough for them)."""
        with self.lock:
            assert set(self.owned) == set(self._queues), (sorted(self.owned), sorted(self._queues))
            assert not (set(self.owned) & set(self.held)), sorted(set(self.owned) & set(self.held))
            assert not (set(self.owned) & self.pending), sorted(set(self.owned) & self.pending)
            assert not (set(self.held) & self.pending), sorted(set(self.held) & self.pending)
            assert set(self._unfetchable) <= set(self._queues), sorted(self._unfetchable)
            assert self._queued_records == sum(len(q.records) for q in self._queues.values())
            assert self._queued_bytes == sum(q.bytes for q in self._queues.values())
