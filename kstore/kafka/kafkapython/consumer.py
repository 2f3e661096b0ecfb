"""The Kafka side of kstore (with :mod:`kstore.kafka.kafkapython.connect`, which makes its clients).

:class:`KafkaSource` owns the consumer, the rebalance listener, per-partition
queues of records already returned by ``poll()`` and the lock that makes
fetching, delivering and resetting a partition never interleave.

Threading (kafka-python 3): rebalance callbacks run on the client's IO thread
while the polling thread waits inside ``poll()``. They must not block, and must
not take :attr:`KafkaSource.lock` (the polling thread may hold it: deadlock).
So the listener only pauses the partitions and records what happened; the
worker's fetch thread acts on those events after ``poll()`` returns.

Invariants (the worker and the ledger rely on them):

- **Owned <=> queued.** A partition has a :class:`_Queue` exactly while the ledger
  delivers it (``Ledger.owned``); :meth:`KafkaSource.own` creates it, :meth:`disown`
  removes it. Records of a partition without a queue are dropped on arrival.
- **Generations are unique per worker.** Every flush (own, reset, disown) gives the
  queue a new generation from one counter that only grows. A batch remembers the
  generation of each partition when taken; putting it back (:meth:`requeue`) only
  happens for a partition whose generation is unchanged, so records fetched before
  a flush can never reach a queue made after it, even a new queue for the same
  partition.
- **Which thread calls what.** The fetch thread calls :meth:`poll` and applies
  rebalance events; the main thread takes batches, requeues them, owns and
  disowns partitions. Both do so under :attr:`lock`. The lock is held across the
  local consumer calls (seek, pause, resume), never across network I/O: poll()
  and the brokers' answers (log bounds) run without it.
- kafka-python 3 raises when ``seek``/``pause``/``resume`` name a partition that
  is no longer assigned (Kafka may revoke it on the IO thread at any moment, before
  the event reaches the worker): those calls go through :meth:`_seek`,
  :meth:`_pause`, :meth:`_resume`, which skip such partitions (the revoke event follows).
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

from kafka import ConsumerRebalanceListener, OffsetAndMetadata, TopicPartition
from kafka.errors import (
    IllegalStateError,
    KafkaError,
    LogTruncationError,
    NoOffsetForPartitionError,
    OffsetOutOfRangeError,
)
from kafka.structs import MemberState

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.seam import MIRROR_METADATA, RECORD_OVERHEAD, EventKind, GroupView
from kstore.records import Record, timestamp_ms
from kstore.records import TopicPartition as TP
from kstore.settings import Settings

from .connect import open_admin, open_consumer
from .members import described_members

log = logging.getLogger("kstore.kafka.consumer")



_key_sizes = operator.attrgetter("serialized_key_size")
_value_sizes = operator.attrgetter("serialized_value_size")


def records_size(records: Sequence[Record]) -> int:
    """Approximate memory held for queued kafka-python records, for the ``max_buffered_bytes`` bound.

    Summed by C loops (``map`` over attribute getters): this runs for every record
    fetched and delivered. A null key or value counts as -1 byte instead of 0.
    """
    payload: int = sum(map(_key_sizes, records)) + sum(map(_value_sizes, records))
    return RECORD_OVERHEAD * len(records) + payload


@dataclass
class _Queue:
    """Records of one owned partition that kstore fetched but has not delivered yet."""

    records: deque[Any] = field(default_factory=deque)
    #: Offset the next fetched record must have at least; anything below is stale. Past the
    #: last queued record when the consumer skipped offsets with nothing to deliver there
    #: (transaction markers, records of aborted transactions): a batch that empties the queue
    #: commits up to here, so the stored offset reaches the log end.
    next_fetch: int = 0
    #: A new value from the source's counter on every flush (never reused, even by a
    #: new queue of the same partition): a batch taken under another generation is stale.
    generation: int = 0
    #: What ``size_of`` said of the queued records, less what was taken: their share of the
    #: source's queued bytes (a batch taking part of the queue takes its share by count).
    bytes: int = 0


#: How long kafka-python may sit mid-rebalance with nothing left in flight before kstore asks it to
#: join again (see StalledRebalance).
STALLED_REBALANCE_S = 2.0


class StalledRebalance:
    """Unsticks kafka-python 3 when a rebalance stalls for good, on the thread that polls.

    When ``poll()``'s timeout expires while the group's leader waits for its SyncGroup answer,
    the join goes on in the background; but the leader's assignment also satisfies the check
    (``need_rejoin()``) that the next ``poll()`` uses to decide whether a join is still to be
    finished. So nothing ever applies the answer: the member stays REBALANCING, its heartbeats
    off, and the listener never hears of the assignment (seen under load, where a worker
    waited for partitions for good after a revoke). That state, held for
    :data:`STALLED_REBALANCE_S` with no join in flight, is asked to rejoin: one rebalance more,
    after which the assignment reaches the listener as usual.
    """

    def __init__(self, consumer: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._consumer = consumer
        self._clock = clock
        self._since: float | None = None
        #: Rejoins requested so far.
        self.rejoins = 0

    def check(self) -> bool:
        """After each ``poll()``: True if a stalled rebalance was just asked to rejoin."""
        # kafka-python's private state: without it (another version), nothing is done.
        coordinator: Any = getattr(self._consumer, "_coordinator", None)
        missing = object()
        task: Any = getattr(coordinator, "_join_task", missing)
        stalled = (task is not missing and getattr(coordinator, "state", None) is MemberState.REBALANCING
                   and (task is None or task.is_done) and not coordinator.need_rejoin())
        now = self._clock()
        if not stalled:
            self._since = None
            return False
        if self._since is None:
            self._since = now
            return False
        if now - self._since < STALLED_REBALANCE_S:
            return False
        log.warning("the Kafka client stalled mid-rebalance (it never applied its join's answer): joining the "
                    "group again")
        coordinator.request_rejoin()
        self._since = None
        self.rejoins += 1
        return True


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Runs on kafka-python's IO thread: pause and record, nothing that blocks."""

    def __init__(self, source: KafkaSource) -> None:
        self._source = source

    def on_partitions_assigned(self, assigned: Any) -> None:
        # Pause first: no record of a new partition may be fetched before the
        # worker has claimed it and sought to the stored offset. Then give each a
        # position (a placeholder: paused, it is never fetched from; the claim seeks
        # it): kafka-python looks up Kafka's committed offset (or resets) only for a
        # partition with no position, and seeks to what it finds even after the
        # worker's own seek, should its lookup still be in flight then. With a
        # position from the start, nothing of Kafka's offsets (a mirror's, or a
        # group's from before kstore) can ever move a partition.
        if assigned:
            consumer = self._source.consumer
            consumer.pause(*assigned)
            for tp in assigned:
                consumer.seek(tp, 0)
        self._source._note_join(self._source.current_member_id())
        self._source._push_event("assigned", assigned)

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._source._push_event("revoked", revoked)

    def on_partitions_lost(self, lost: Any) -> None:
        self._source._push_event("lost", lost)


class KafkaSource:
    """The narrow seam between the worker and Kafka."""

    #: Whether the queued records are :class:`~kstore.records.Message` tuples already (raw bytes),
    #: which a processor that deserializes nothing is handed as they are. kafka-python's are its own.
    queues_messages: ClassVar[bool] = False
    #: Whether :meth:`group_members` can describe the group (the one-database guard needs it).
    describes_group: ClassVar[bool] = True

    @staticmethod
    def size_of(records: Sequence[Any]) -> int:
        """Approximate memory of queued records (the one function for what is queued and taken)."""
        return records_size(records)

    def __init__(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        #: Rebalances seen so far (each assignment, even of no partition; on confluent's incremental
        #: protocols each revoke too), and this member's id in the group as of the last: set by the
        #: client's callbacks, read by the one-database guard.
        self.joins = 0
        self.member_id: str | None = None
        self._admin: Any = None
        self.group = group
        self.topics = list(topics)
        #: Held while queues change and while a partition is flushed and sought.
        self.lock = threading.RLock()
        #: Notified (under :attr:`lock`) when records were queued or the group changed.
        self.changed = threading.Condition(self.lock)
        self._queues: dict[TP, _Queue] = {}
        self._generations = itertools.count(1)
        #: Where take_batch starts its round across the partitions (rotates).
        self._next_first = 0
        self._queued_records = 0
        self._queued_bytes = 0
        #: Fetching is paused for every owned partition while the queues hold too much.
        self._throttled = False
        self._events: list[tuple[EventKind, list[TP]]] = []
        #: Offsets committed to the database, to mirror to Kafka (``mirror_offsets``) on the fetch thread.
        self._mirror: dict[TP, int] = {}
        self._events_lock = threading.Lock()  # the only lock the IO thread takes
        #: Owned partitions kafka-python could not fetch from, paused: the offset it wanted and,
        #: if the log was truncated below it, what it said (the worker places them again).
        self._unfetchable: dict[TP, tuple[int, str | None]] = {}
        self.consumer = self._connect()
        self._stalled = StalledRebalance(self.consumer)

    def _connect(self) -> Any:
        s = self.settings
        return open_consumer(
            s,
            group_id=self.group,
            client_id=s.client_id or self.worker_id,
            # Offsets live in the database; Kafka's committed offsets are
            # never written (kafka-python seeks to any it finds).
            enable_auto_commit=False,
            # Never move a position by itself: with a policy, kafka-python silently resets a
            # position that left the log (retention deleted records not yet processed, a
            # truncation) and the messages skipped go unnoticed. With "none" it raises, and
            # kstore places the partition again itself, loudly (see poll).
            auto_offset_reset="none",
            allow_auto_create_topics=False,
            max_poll_records=s.max_poll_records,
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            max_poll_interval_ms=s.max_poll_interval_ms,
        )

    def check_topics(self) -> None:
        """Raise a clear error if a topic does not exist (topics are never auto-created)."""
        try:
            known = self.consumer.topics()
        except KafkaError as exc:
            raise BrokerError(f"cannot list topics at {self.settings.bootstrap_servers}: {exc}") from None
        missing = [t for t in self.topics if t not in known]
        if missing:
            raise ConfigurationError(
                f"unknown topic(s) {', '.join(missing)} at {self.settings.bootstrap_servers}: create them first"
            )

    def subscribe(self) -> None:
        """Join the group (at the next poll); the listener pauses every partition it is given."""
        self.consumer.subscribe(self.topics, listener=_Listener(self))
        # Then read the cluster's metadata once more, now that the topics are subscribed, before the
        # first poll joins the group. kafka-python's group leader remembers the topics' partitions
        # as of its last metadata answer, and compares them with the next answer after assigning:
        # from before the subscription (empty), they differ, and a second rebalance follows the
        # first at once (every partition assigned, revoked and assigned again, claimed twice).
        try:
            self.consumer.topics()
        except KafkaError as exc:
            raise BrokerError(f"cannot read the metadata of {', '.join(self.topics)} at "
                              f"{self.settings.bootstrap_servers}: {exc}") from None

    def _note_join(self, member_id: str | None) -> None:
        """A rebalance reached this member (on the client's callback thread): count it, note the member id."""
        with self._events_lock:
            self.joins += 1
            self.member_id = member_id or None

    def current_member_id(self) -> str | None:
        """This member's id in the group, as kafka-python knows it now (any thread: a local read)."""
        return str(self.consumer.group_metadata().member_id or "") or None

    def group_members(self) -> GroupView:
        """The group's live members, as Kafka's describe group gives them.

        On the main thread, through an admin client of its own (never the group's consumer).
        Raises :class:`BrokerError` if the brokers do not answer (the caller retries later)."""
        try:
            if self._admin is None:
                self._admin = open_admin(self.settings)
            return described_members(self._admin, self.group)
        except KafkaError as exc:
            raise BrokerError(f"cannot describe group {self.group!r}: {exc}") from exc

    def _push_event(self, kind: EventKind, tps: Iterable[Any]) -> None:
        with self._events_lock:
            self._events.append((kind, [(tp.topic, tp.partition) for tp in tps]))

    def take_events(self) -> list[tuple[EventKind, list[TP]]]:
        """Rebalance events since the last call, in the order they happened."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    # -- fetching ---------------------------------------------------------

    def poll(self, timeout_ms: int, max_records: int | None = None) -> int:
        """Poll Kafka and queue what came back (at most ``max_records``) for partitions this worker owns.

        Returns the number of records queued. Records of a partition that was
        flushed (reset, revoked, fenced) while ``poll()`` ran are dropped: they
        were fetched for a position that no longer holds.
        """
        with self.lock:
            before = {tp: q.generation for tp, q in self._queues.items()}
        return self._queue_fetched(before, self._fetch(timeout_ms, max_records))

    def _fetch(self, timeout_ms: int, max_records: int | None) -> Iterable[tuple[TP, Sequence[Any]]]:
        """One ``poll()`` of the client: its records by partition, in offset order (no lock held)."""
        try:
            batches = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except (OffsetOutOfRangeError, LogTruncationError, NoOffsetForPartitionError) as exc:
            self._cannot_fetch(exc)
            return ()
        finally:
            self._stalled.check()
        return [((ktp.topic, ktp.partition), krecords) for ktp, krecords in batches.items()]

    def _queue_fetched(self, before: Mapping[TP, int], batches: Iterable[tuple[TP, Sequence[Any]]]) -> int:
        """Queue what one poll fetched; ``before``: the queues' generations when it started."""
        queued = 0
        with self.lock:
            for tp, krecords in batches:
                q = self._queues.get(tp)
                if q is None:
                    continue  # not ours (any more); a claim will seek it before it is resumed
                if before.get(tp) != q.generation:
                    # Flushed and sought while poll() ran. These records may come from
                    # before or after that seek, but kafka-python's position moved past
                    # them either way: seek again, or records after the seek are lost.
                    self._seek(tp, q.next_fetch)
                    continue
                queued += self._enqueue(q, krecords)
            self._note_skipped(before)
            if queued:
                self._throttle()
                self.changed.notify_all()
        return queued

    def _enqueue(self, q: _Queue, krecords: Sequence[Any]) -> int:
        if krecords[0].offset < q.next_fetch:
            # Stale: fetched before a seek backwards. Records come in offset order.
            krecords = [kr for kr in krecords if kr.offset >= q.next_fetch]
            if not krecords:
                return 0
        q.records.extend(krecords)
        q.next_fetch = krecords[-1].offset + 1
        size = self.size_of(krecords)
        q.bytes += size
        self._queued_bytes += size
        self._queued_records += len(krecords)
        return len(krecords)

    def _cannot_fetch(self, exc: KafkaError) -> None:
        """kafka-python has no reset policy (``auto_offset_reset="none"``) and raised for some
        partitions: pause them, and note the owned ones for the worker (:meth:`unfetchable`).

        Out of range: its position is no longer in the log (below the log start, or past
        the end). Truncated: the log was cut below its position (kafka-python keeps the
        position). No offset: a partition assigned but not sought yet; the listener gives
        every new partition a position, so only a race can do that: it gets the same
        placeholder, paused until its claim seeks it.
        """
        found: dict[Any, tuple[int | None, str | None]] = {}
        if isinstance(exc, OffsetOutOfRangeError) and exc.args and isinstance(exc.args[0], dict):
            found = {ktp: (int(offset), None) for ktp, offset in exc.args[0].items()}
        elif isinstance(exc, LogTruncationError):
            found = {ktp: (None, f"the log was truncated below this worker's position (first diverging offset "
                                 f"{'unknown' if d is None else d.offset}; an unclean leader election?)")
                     for ktp, d in exc.divergent_offsets.items()}
        elif isinstance(exc, NoOffsetForPartitionError) and exc.args:
            with self.lock:
                for ktp in exc.args[0]:
                    self._pause([(ktp.topic, ktp.partition)])
                    self._seek((ktp.topic, ktp.partition), 0)
            return
        with self.lock:
            for ktp, (offset, truncated) in found.items():
                tp = (ktp.topic, ktp.partition)
                self._pause([tp])
                q = self._queues.get(tp)
                if q is None:
                    log.debug("%s[%d] cannot be fetched (%s) but is not delivered here: left paused", *tp, exc)
                    continue
                if offset is not None and offset != q.next_fetch:
                    # Not where kstore reads from (a seek overtook the fetch): read from there.
                    self._seek(tp, q.next_fetch)
                    if not self._throttled:
                        self._resume([tp])
                    continue
                self._unfetchable[tp] = (q.next_fetch, truncated)

    def unfetchable(self) -> dict[TP, tuple[int, str | None]]:
        """Owned partitions kafka-python could not fetch from: ``{tp: (offset, truncated)}``,
        paused until :meth:`own` places them again (or they are disowned)."""
        with self.lock:
            return dict(self._unfetchable)

    def _note_skipped(self, before: Mapping[TP, int]) -> None:
        """After a poll: where the consumer moved past the last queued record with nothing to
        return, remember its position. Lock held.

        kafka-python moves its position past transaction markers and records of aborted
        transactions (read_committed) without returning anything for them, sometimes in a
        poll that returns no record at all. Only forward moves of partitions not flushed
        during the poll count: every record the consumer returned below its position has
        been queued (or dropped as stale, below ``next_fetch``), so nothing deliverable lies
        between ``next_fetch`` and the position.
        """
        for tp, q in self._queues.items():
            if before.get(tp) != q.generation:
                continue
            position = self._fetch_position(tp)
            if position is not None and position > q.next_fetch:
                q.next_fetch = position

    def _fetch_position(self, tp: TP) -> int | None:
        """The consumer's fetch position, from kafka-python's own state: its ``position()``
        may ask the brokers, or start a reset, and this runs after every poll. A consumer
        that is not kafka-python's (a test double) is asked through ``position()``."""
        subscription = getattr(self.consumer, "_subscription", None)
        if subscription is None:
            try:
                found = self.consumer.position(TopicPartition(*tp))
            except IllegalStateError:
                return None
            return None if found is None else int(found)
        state = subscription.assignment.get(TopicPartition(*tp))
        position = None if state is None else state.position
        return None if position is None else int(position.offset)

    def skipped(self, committed: Mapping[TP, int]) -> dict[TP, int]:
        """Owned partitions with nothing queued whose consumer moved past their ``committed``
        offset (transaction markers, aborted records only): ``{tp: offset to commit}``."""
        with self.lock:
            return {tp: q.next_fetch for tp, q in self._queues.items()
                    if not q.records and tp in committed and q.next_fetch > committed[tp]}

    def _throttle(self) -> None:
        """Pause fetching while the queues hold ``max_buffered_bytes``; resume below half. Lock held.

        Memory is bounded by this setting, not by the topic's size, and the
        fetcher keeps calling poll() meanwhile, so the group membership stays alive.
        """
        limit = self.settings.max_buffered_bytes
        if not self._throttled and self._queued_bytes >= limit:
            self._throttled = True
            self._pause(self._queues)
        elif self._throttled and self._queued_bytes <= limit // 2:
            self._throttled = False
            self._resume(tp for tp in self._queues if tp not in self._unfetchable)

    def room(self, limit: int, timeout_s: float) -> int:
        """How many records may be queued before ``limit`` is reached; waits up to
        ``timeout_s`` (for a batch to be taken) while there is no room."""
        with self.lock:
            if self._queued_records >= limit:
                self.changed.wait(timeout_s)
            return max(0, limit - self._queued_records)

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

    def heads(self) -> dict[TP, tuple[int | None, int | None]]:
        """For each owned partition: the last high watermark a fetch reported (None before
        the first) and the timestamp (ms) of the first queued record (None if none is queued).
        Local state only: no broker call."""
        with self.lock:
            return {tp: (self._highwater(tp), timestamp_ms(q.records[0]) if q.records else None)
                    for tp, q in self._queues.items()}

    def _highwater(self, tp: TP) -> int | None:
        try:
            return self.consumer.highwater(TopicPartition(*tp))  # type: ignore[no-any-return]
        except IllegalStateError:  # revoked on the IO thread a moment ago; its revoke event follows
            return None

    def mirror(self, offsets: Mapping[TP, int]) -> None:
        """Queue committed offsets for :meth:`flush_mirror` (any thread)."""
        with self.lock:
            self._mirror.update(offsets)

    def flush_mirror(self) -> None:
        """On the fetch thread, after a poll: commit the queued offsets to Kafka, asynchronously,
        marked as a mirror. Only for lag tools: kstore never reads them (see the listener)."""
        with self.lock:
            offsets, self._mirror = self._mirror, {}
        if not offsets:
            return
        assigned = self.consumer.assignment()
        commit = {TopicPartition(*tp): OffsetAndMetadata(offset, MIRROR_METADATA, -1) for tp, offset in offsets.items()
                  if TopicPartition(*tp) in assigned}
        if commit:
            self.consumer.commit_async(commit, callback=_mirrored)

    def group_stable(self) -> bool:
        """Whether the consumer has joined its group and is heartbeating (kafka-python's own view)."""
        return bool(self.consumer.group_metadata().state == MemberState.STABLE)

    def buffered(self) -> tuple[int, int, bool]:
        """Records and bytes waiting in kstore's queues, and whether fetching is paused for them."""
        return self._queued_records, self._queued_bytes, self._throttled

    def has_records(self, tp: TP) -> bool:
        q = self._queues.get(tp)
        return q is not None and bool(q.records)

    def generation(self, tp: TP) -> int | None:
        q = self._queues.get(tp)
        return None if q is None else q.generation

    def requeue(self, records: Sequence[Record], generations: dict[TP, int]) -> None:
        """Put records of an uncommitted batch back at the front of their queues.

        Same effect as seeking back to the batch's first offset (kafka-python
        has already moved past them) without fetching them again. Partitions
        flushed since the batch was taken keep their new position.
        """
        with self.lock:
            for record in reversed(records):
                tp = (record.topic, record.partition)
                q = self._queues.get(tp)
                if q is not None and q.generation == generations.get(tp):
                    q.records.appendleft(record)
                    self._queued_records += 1
                    size = self.size_of([record])
                    q.bytes += size
                    self._queued_bytes += size

    # -- ownership and position ------------------------------------------

    def own(self, tp: TP, offset: int) -> None:
        """Start delivering ``tp`` from ``offset``: flush, seek, resume. Caller holds :attr:`lock`."""
        q = self._queues.setdefault(tp, _Queue())
        self._flush(q)
        self._unfetchable.pop(tp, None)
        q.next_fetch = offset
        self._seek(tp, offset)
        if self._throttled:
            self._throttle()  # the flush may have made room: resume everything (this one included)
        if not self._throttled:
            self._resume([tp])

    def _flush(self, q: _Queue) -> None:
        self._queued_records -= len(q.records)
        self._queued_bytes -= q.bytes
        q.bytes = 0
        q.records.clear()
        q.generation = next(self._generations)

    # kafka-python 3 raises ValueError (seek) or KeyError (pause, resume) for a partition
    # that is not assigned. Kafka can take one away on its IO thread at any moment, and
    # the worker hears of it at the next event: until then, skip it.

    def _seek(self, tp: TP, offset: int) -> None:
        try:
            self.consumer.seek(TopicPartition(*tp), offset)
        except (ValueError, KeyError):
            log.debug("%s[%d] is no longer assigned: not seeking it", *tp)

    def _pause(self, tps: Iterable[TP]) -> None:
        self._each(self.consumer.pause, tps, "pausing")

    def _resume(self, tps: Iterable[TP]) -> None:
        self._each(self.consumer.resume, tps, "resuming")

    @staticmethod
    def _each(call: Callable[[TopicPartition], None], tps: Iterable[TP], doing: str) -> None:
        for tp in tps:
            try:
                call(TopicPartition(*tp))
            except (ValueError, KeyError):
                log.debug("%s[%d] is no longer assigned: not %s it", tp[0], tp[1], doing)

    def disown(self, tps: Iterable[TP], pause: bool = False) -> None:
        """Stop delivering ``tps`` and flush their queues (revoked, lost or fenced)."""
        with self.lock:
            for tp in tps:
                q = self._queues.pop(tp, None)
                self._unfetchable.pop(tp, None)
                if q is not None:
                    self._flush(q)
                if pause:
                    self._pause([tp])
            if self._throttled:
                # The flush may have freed enough: if nothing re-evaluated the bound, the
                # other partitions would stay paused with empty queues for good.
                self._throttle()

    def assignment(self) -> set[TP]:
        return {(tp.topic, tp.partition) for tp in self.consumer.assignment()}

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        """``(log start, log end)`` offsets of each partition, asked of the brokers.

        Raises :class:`BrokerError` if the brokers do not answer (the caller retries later).
        """
        try:
            return log_bounds(self.consumer, tps)
        except KafkaError as exc:
            raise BrokerError(f"cannot read the log bounds of {len(tps)} partition(s): {exc}") from exc

    def offsets_for_times(self, targets: dict[TP, datetime]) -> dict[TP, int | None]:
        """The first offset at or after each time, or None when no record is that recent."""
        try:
            return offsets_for_times(self.consumer, targets)
        except KafkaError as exc:
            raise BrokerError(f"cannot look up offsets by time: {exc}") from exc

    def close(self) -> None:
        """Leave the group without committing anything to Kafka."""
        self.consumer.close(autocommit=False)
        if self._admin is not None:
            self._admin.close()


def _mirrored(offsets: Any, response: Any) -> None:
    """A mirror commit's answer: a failure (a rebalance under way) is only logged; the next commit mirrors again."""
    if isinstance(response, BaseException):
        log.debug("mirroring offsets to Kafka failed (harmless; the next commit mirrors again): %s", response)


def log_bounds(consumer: Any, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
    ktps = [TopicPartition(*tp) for tp in tps]
    if not ktps:
        return {}
    starts = consumer.beginning_offsets(ktps)
    ends = consumer.end_offsets(ktps)
    return {(k.topic, k.partition): (starts[k], ends[k]) for k in ktps}


def offsets_for_times(consumer: Any, targets: dict[TP, datetime]) -> dict[TP, int | None]:
    query = {TopicPartition(*tp): int(when.timestamp() * 1000) for tp, when in targets.items()}
    found = consumer.offsets_for_times(query)
    return {(k.topic, k.partition): (v.offset if v is not None else None) for k, v in found.items()}
