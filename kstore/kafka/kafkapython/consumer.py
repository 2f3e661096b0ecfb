"""The worker's consumer on kafka-python: :class:`KafkaPythonSource`, a
:class:`~kstore.kafka.seam.ConsumerSource`.

It fetches, reports rebalances and seeks, pauses and resumes when the engine says; the queues of
fetched records and every partition's state are the engine's (:mod:`kstore.engine.partitions`).

Threading (kafka-python 3): rebalance callbacks run on the client's IO thread while the fetch
thread waits inside ``poll()``. They must not block and must not take the engine's lock (the main
thread may hold it, inside a ``seek``): the listener pauses the partitions it is given and posts
what happened; the worker's fetch thread acts on it after ``poll()`` returns.

kafka-python 3 raises when ``seek``/``pause``/``resume`` name a partition that is no longer
assigned (Kafka may revoke it on the IO thread at any moment, before the event reaches the
worker): those calls skip such partitions (the revoke event follows).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from kstore.kafka.seam import MIRROR_METADATA, NO_POSITION, RECORD_OVERHEAD, Fetched, GroupView, OnRebalance, Refused
from kstore.settings import Settings
from kstore.types import Record
from kstore.types import TopicPartition as TP

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
    """Runs on kafka-python's IO thread: pause and post, nothing that blocks."""

    def __init__(self, source: KafkaPythonSource, on_rebalance: OnRebalance) -> None:
        self._source = source
        self._post = on_rebalance

    def on_partitions_assigned(self, assigned: Any) -> None:
        # Pause first: no record of a new partition may be fetched before the worker has
        # claimed it and sought to the stored offset. Then give each a position (a placeholder:
        # paused, it is never fetched from; the claim seeks it): kafka-python looks up Kafka's
        # committed offset (or resets) only for a partition with no position, and seeks to what it
        # finds even after the worker's own seek, should its lookup still be in flight then. With a
        # position from the start, nothing of Kafka's offsets (a mirror's, or a group's from before
        # kstore) can ever move a partition.
        if assigned:
            consumer = self._source.consumer
            consumer.pause(*assigned)
            for tp in assigned:
                consumer.seek(tp, 0)
        self._source._note_join(self._source.current_member_id())
        self._post("assigned", _plain(assigned))

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._post("revoked", _plain(revoked))

    def on_partitions_lost(self, lost: Any) -> None:
        self._post("lost", _plain(lost))


def _plain(tps: Iterable[Any]) -> list[TP]:
    return [(tp.topic, tp.partition) for tp in tps]


class KafkaPythonSource:
    """The worker's consumer on kafka-python (see the module's docstring)."""

    queues_messages: ClassVar[bool] = False
    describes_group: ClassVar[bool] = True
    callbacks_may_lock: ClassVar[bool] = False

    @staticmethod
    def size_of(records: Sequence[Any]) -> int:
        """Approximate memory of fetched kafka-python records."""
        return records_size(records)

    def __init__(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.group = group
        self.topics = list(topics)
        #: Rebalances seen so far (each assignment, even of no partition), and this member's id in
        #: the group as of the last: set by the listener, read by the one-database guard.
        self.joins = 0
        self.member_id: str | None = None
        self._admin: Any = None
        self._joins_lock = threading.Lock()  # the only lock of this class the IO thread takes
        #: Offsets committed to the database, to mirror to Kafka (``mirror_offsets``) on the fetch thread.
        self._mirror: dict[TP, int] = {}
        self._mirror_lock = threading.Lock()
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

    def subscribe(self, on_rebalance: OnRebalance) -> None:
        """Join the group (at the next poll); the listener pauses every partition it is given."""
        self.consumer.subscribe(self.topics, listener=_Listener(self, on_rebalance))
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
        with self._joins_lock:
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

    # -- fetching: the fetch thread ---------------------------------------------------

    def fetch(self, timeout_ms: int, max_records: int) -> Fetched:
        """One ``poll()`` of the client: its records by partition, in offset order, and the
        partitions it raised for (no reset policy: see :meth:`_refused`)."""
        try:
            batches = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except (OffsetOutOfRangeError, LogTruncationError, NoOffsetForPartitionError) as exc:
            return Fetched((), self._refused(exc))
        finally:
            self._stalled.check()
        return Fetched([((ktp.topic, ktp.partition), krecords) for ktp, krecords in batches.items()])

    @staticmethod
    def _refused(exc: KafkaError) -> list[Refused]:
        """kafka-python has no reset policy (``auto_offset_reset="none"``) and raised for some partitions.

        Out of range: its position is no longer in the log (below the log start, or past the end).
        Truncated: the log was cut below its position (kafka-python keeps the position). No offset:
        a partition assigned but not sought yet; the listener gives every new partition a position,
        so only a race can do that: the engine pauses it until a claim places it (owned, it is placed
        again where kstore reads from).
        """
        if isinstance(exc, OffsetOutOfRangeError) and exc.args and isinstance(exc.args[0], dict):
            return [Refused((ktp.topic, ktp.partition), int(offset)) for ktp, offset in exc.args[0].items()]
        if isinstance(exc, LogTruncationError):
            return [Refused((ktp.topic, ktp.partition), None,
                            f"the log was truncated below this worker's position (first diverging offset "
                            f"{'unknown' if d is None else d.offset}; an unclean leader election?)")
                    for ktp, d in exc.divergent_offsets.items()]
        if isinstance(exc, NoOffsetForPartitionError) and exc.args:
            return [Refused((ktp.topic, ktp.partition), NO_POSITION) for ktp in exc.args[0]]
        return []

    def positions(self, tps: Sequence[TP]) -> dict[TP, int]:
        """The fetch positions, from kafka-python's own state: its ``position()`` may ask the
        brokers, or start a reset, and this runs after every poll. A consumer that is not
        kafka-python's (a test double) is asked through ``position()``."""
        found: dict[TP, int] = {}
        subscription = getattr(self.consumer, "_subscription", None)
        for tp in tps:
            if subscription is None:
                try:
                    position = self.consumer.position(TopicPartition(*tp))
                except IllegalStateError:
                    continue
            else:
                state = subscription.assignment.get(TopicPartition(*tp))
                position = None if state is None or state.position is None else state.position.offset
            if position is not None:
                found[tp] = int(position)
        return found

    def highwater(self, tp: TP) -> int | None:
        try:
            return self.consumer.highwater(TopicPartition(*tp))  # type: ignore[no-any-return]
        except IllegalStateError:  # revoked on the IO thread a moment ago; its revoke event follows
            return None

    def mirror(self, offsets: Mapping[TP, int]) -> None:
        """Queue committed offsets for :meth:`flush_mirror` (any thread)."""
        with self._mirror_lock:
            self._mirror.update(offsets)

    def flush_mirror(self) -> None:
        """On the fetch thread, after a poll: commit the queued offsets to Kafka, asynchronously,
        marked as a mirror. Only for lag tools: kstore never reads them (see the listener)."""
        with self._mirror_lock:
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

    # -- position: at once, under the engine's lock ---------------------------------------
    # kafka-python 3 raises ValueError (seek) or KeyError (pause, resume) for a partition that is
    # not assigned. Kafka can take one away on its IO thread at any moment, and the worker hears of
    # it at the next event: until then, skip it.

    def seek(self, tp: TP, offset: int) -> None:
        try:
            self.consumer.seek(TopicPartition(*tp), offset)
        except (ValueError, KeyError):
            log.debug("%s[%d] is no longer assigned: not seeking it", *tp)

    def pause(self, tps: Sequence[TP]) -> None:
        self._each(self.consumer.pause, tps, "pausing")

    def resume(self, tps: Sequence[TP]) -> None:
        self._each(self.consumer.resume, tps, "resuming")

    def release(self, tps: Sequence[TP]) -> None:
        self.pause(tps)

    @staticmethod
    def _each(call: Callable[[TopicPartition], None], tps: Iterable[TP], doing: str) -> None:
        for tp in tps:
            try:
                call(TopicPartition(*tp))
            except (ValueError, KeyError):
                log.debug("%s[%d] is no longer assigned: not %s it", tp[0], tp[1], doing)

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
