"""The worker's consumer on confluent-kafka (librdkafka): :class:`ConfluentSource`, a
:class:`~kstore.kafka.seam.ConsumerSource` (``kafka_client="confluent"``, the default).

It fetches, reports rebalances and seeks, pauses and resumes when the engine says; the queues of
fetched records and every partition's state are the engine's (:mod:`kstore.engine.partitions`).

Threading (librdkafka is not kafka-python):

- **Only the fetch thread calls the consumer.** ``consume()`` also runs
  the rebalance callbacks, on the thread that calls it (kafka-python runs them on its IO
  thread): they pause, assign and post the event to the engine. As nothing waits on the consumer
  while holding the engine's lock, the engine may apply a revoke or a loss right there, inside the
  callback (``callbacks_may_lock``): a batch in flight then sees its partition gone before it commits.
- **The main thread never calls the consumer while it consumes.** Many of confluent-kafka's
  calls (``assignment``, ``pause``, ``resume``, ``memberid``) wait for librdkafka's own threads
  while holding Python's GIL; with the fetch thread inside ``consume()`` about to run a
  rebalance callback (which needs the GIL), that was seen to hang the worker for good. So what
  the engine decides (own, disown, a reset, the throttle) changes its queues at once, under its
  lock, and leaves the consumer's part (seek, pause, resume) as a wish that the fetch thread
  carries out before its next ``consume()``. Nothing is delivered early meanwhile: a
  partition whose queue changed while a ``consume()`` ran has that round's records dropped (the
  generations, as with kafka-python), and one with no queue has all of them dropped.
  ``assignment()`` and ``group_stable()`` answer from what the callbacks recorded.
- The brokers' answers the main thread needs (log bounds, offsets by time) come from a second
  librdkafka handle that never subscribes: asked of the group's consumer while another thread
  was inside its ``consume()``, ``get_watermark_offsets`` and ``offsets_for_times`` were seen to
  hang past their own timeouts, for good.
- **Heartbeats are librdkafka's own threads'.** Nothing kstore does (a long batch, a claim
  waiting on a row lock) delays them; ``max.poll.interval.ms`` counts between two
  ``consume()`` calls, which the fetch thread makes all the time.
- ``close()`` only once the fetch thread has stopped (the worker joins it first).

Assignment (``rebalance_protocol``): ``eager`` (range, like kafka-python's), ``cooperative`` (the
classic protocol with librdkafka's cooperative-sticky assignor) or ``consumer`` (Kafka's
next-generation group protocol, KIP-848: the broker assigns). In ``on_assign`` kstore pauses the
new partitions, then assigns them at a placeholder offset (0) and pauses them again: with eager
``assign()`` (the callback names the whole assignment), with the incremental two
``incremental_assign()`` (it names only the partitions added; those kept go on being fetched and
delivered, untouched). It must assign there (otherwise confluent-kafka assigns them itself,
without offsets, and librdkafka would start from Kafka's committed offsets, which kstore never
reads), and it cannot assign at the stored offsets there: those come from the claim, a database
transaction on the main thread, which must not run inside ``consume()``. A concrete placeholder
starts the partition's fetcher with no request to Kafka (``seek`` needs a started fetcher) and,
paused, is never fetched from. The claim then seeks each partition to its stored offset and
resumes it, as with kafka-python. Anything fetched for a partition before its claim is dropped
all the same (no queue; librdkafka also discards what was fetched before a seek or a pause).

How kstore's claim holds on each protocol:

- **A revoke** (``on_revoke``) names, on the incremental protocols, only the partitions that
  move: those are dropped from the ledger and their queues flushed before the callback returns
  (``unassign``/``incremental_unassign``), the others go on. The batch in flight may hold records
  of a revoked partition: just before its offsets are written, the batch checks that it still
  holds every partition it would commit (:meth:`~kstore.engine.ownership.Ledger.dropped`), and
  commits nothing (rolls back, retries the rest) if not. A revoke that lands after that check,
  in the last round trip, is met by the epoch: the new owner's claim bumps it, so a commit that
  comes after the claim matches nothing and rolls back, and one that comes before is simply
  read by the claim (the row lock orders them). Eager or not, the guarantee is per partition;
  nothing waits.
- **New partitions** are paused and claimed before any delivery, as above, on every protocol.
- **A loss** (``on_lost``: librdkafka learnt the member's session expired, a SIGSTOPped zombie
  that woke) drops the named partitions the same way (every partition, in practice) and commits
  nothing of them: the batch in flight is stopped by the same check, or by the epoch.
- **An operator's reset** bumps the epoch and keeps the row's owner: the worker's next commit
  (or its periodic epoch check) is fenced, it reads the row, sees itself as owner and adopts the
  new position (flush, seek). No rebalance is involved, so all three protocols behave alike.
- **A fence by another worker's claim** (the row names another owner) drops the partition,
  paused, but Kafka may still assign it here: on eager a later rebalance would re-offer it, on the
  incremental protocols nothing ever would. The ledger therefore claims it again by itself once a
  session timeout (``session_timeout_ms``) has passed and Kafka still assigns it here
  (``Ledger.reclaim_orphans``). That cannot steal it from a live new owner: every protocol gives a
  partition to one live member at a time (eager and cooperative revoke before they assign
  elsewhere; KIP-848's broker assigns a partition only once its previous owner has released it
  or been fenced), so a worker Kafka still assigns a partition to *is* its owner, and the other
  claimer was a zombie acting on an assignment it had lost. The wait only has to outlast the
  zombie learning of its loss (its next heartbeat; it then drops the partition and, not assigned
  it any more, never re-claims it): re-claiming at once could make the two take it from each other
  in turn while the zombie has not heard yet. Exactly-once never depends on that timing (the
  epoch and compare-and-set make every commit continue the stored offset); liveness does.
  With ``consumer`` the session timeout and heartbeat are the broker's
  (``group.consumer.session.timeout.ms``, 45 s, ``group.consumer.heartbeat.interval.ms``, 5 s, by
  default) and librdkafka refuses them on the client: kstore does not send ``session_timeout_ms``
  and ``heartbeat_interval_ms`` then, and uses ``session_timeout_ms`` only as that wait, which must
  stay above the broker's heartbeat interval (10 s against 5 s by default).

A group runs one protocol: eager and cooperative members do not mix (switch by stopping every
worker, or by a rolling restart through a group that lists both assignors, which kstore does not
offer), and KIP-848 members join only a group on the consumer protocol (or an empty classic one).

Where librdkafka cannot fetch (``auto.offset.reset=error``: the stored position left the log),
it stops the partition's fetcher and says so in an error message: the partition is paused and
noted in :meth:`unfetchable`, as with kafka-python. A stopped fetcher refuses ``seek``, so
placing it again assigns the whole assignment afresh, at kstore's positions (eager), or takes
that partition out and puts it back at kstore's position (incremental: ``assign()`` would replace
the assignment the group's incremental callbacks keep).

"One pipeline, one database" is the engine's (:mod:`kstore.engine.onedatabase`), as with
kafka-python: :meth:`group_members` describes the group through confluent-kafka's admin client.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from confluent_kafka import Consumer, ConsumerGroupState, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from kstore import types
from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.seam import (
    MIRROR_METADATA,
    RECORD_OVERHEAD,
    EventKind,
    Fetched,
    GroupMember,
    GroupView,
    OnRebalance,
    Refused,
)
from kstore.settings import Settings
from kstore.types import TopicPartition as TP

from .connect import broker_error, describe, librdkafka_config, open_rd_consumer

log = logging.getLogger("kstore.kafka.consumer")
_T = TypeVar("_T")

#: Where a newly assigned partition "is" until its claim seeks it: paused, never fetched from.
PLACEHOLDER_OFFSET = 0
#: librdkafka's answer for a position it does not know.
_INVALID = -1001
#: How long a question to the brokers (log bounds, offsets by time) may take.
REQUEST_TIMEOUT_S = 10.0
#: librdkafka's ``fetch.queue.backoff.ms`` unless the user sets it: how long it stops fetching a
#: partition once its local queue holds ``queued.min.messages`` (100,000 records). At its default,
#: 1000 ms, a backlog came in bursts: a worker drained the queue in a quarter of a second, then
#: waited most of a second for the next fetch (a no-op worker drained 1,000,000 records at about
#: 170,000/s; at 100 ms, at 450,000 to 750,000/s). Lower values cost the broker thread a check per
#: backoff, nothing more: the queue's bounds stay librdkafka's.
FETCH_QUEUE_BACKOFF_MS = 100


_get = (Message.topic, Message.partition, Message.offset, Message.key, Message.value)
_get_but_topic = _get[1:]
_timestamp_ms = operator.itemgetter(1)
_is_error = functools.partial(operator.is_not, None)
_tuple_new = tuple.__new__
_messages = itertools.repeat(types.Message)
_topic_partition_of = operator.itemgetter(0, 1)
_partition_of = operator.itemgetter(1)
_key_of = operator.itemgetter(3)
_value_of = operator.itemgetter(4)


def to_messages(messages: Sequence[Message], topic: str | None = None) -> list[types.Message]:
    """What kstore queues for librdkafka's messages (none of them an error), in their order: the
    :class:`kstore.Message` a processor that deserializes nothing is handed as it is. ``topic``:
    every message's topic, when only one is subscribed (not asked of each message then).

    Built by C loops: ``map`` over confluent-kafka's own accessors, ``zip`` and ``tuple.__new__``
    (mapped straight, not through a partial), with no Python call per message (a Python loop here
    was about a quarter of a no-op worker's CPU). A record without headers has ``()``, as a
    Message promises (librdkafka says None).
    """
    headers: list[Any] = list(map(Message.headers, messages))
    bare = headers.count(None)
    if bare == len(headers):
        headers = [()] * bare
    elif bare:
        headers = [() if h is None else h for h in headers]
    stamps = map(_timestamp_ms, map(Message.timestamp, messages))
    columns: list[Iterable[Any]] = [map(get, messages) for get in (_get if topic is None else _get_but_topic)]
    if topic is not None:
        columns.insert(0, itertools.repeat(topic, len(headers)))
    fields = zip(*columns, headers, stamps, strict=True)
    return list(map(_tuple_new, _messages, fields))


def by_partition(queued: Sequence[types.Message], topic: str | None = None) -> dict[TP, list[types.Message]]:
    """``queued`` by partition, each partition's in the order given (librdkafka hands over runs of
    one partition's records: one Python step per run, not per record). ``topic``: every record's
    topic, when only one is subscribed (then only the partition numbers are compared)."""
    fetched: dict[TP, list[types.Message]] = {}
    runs = (itertools.groupby(queued, _topic_partition_of) if topic is None
            else (((topic, p), run) for p, run in itertools.groupby(queued, _partition_of)))
    for tp, run in runs:
        got = fetched.get(tp)
        if got is None:
            fetched[tp] = list(run)
        else:
            got.extend(run)
    return fetched


def messages_size(queued: Sequence[types.Message]) -> int:
    """Approximate memory held for queued :class:`kstore.Message` tuples, for ``max_buffered_bytes``:
    :data:`RECORD_OVERHEAD` each and the bytes of its key and value (a null one counts 0). Summed by
    C loops; it runs for every record fetched and delivered."""
    payload: int = (sum(map(len, filter(None, map(_key_of, queued))))
                    + sum(map(len, filter(None, map(_value_of, queued)))))
    return RECORD_OVERHEAD * len(queued) + payload


class ConfluentSource:
    """The worker's consumer on confluent-kafka (librdkafka), a
    :class:`~kstore.kafka.seam.ConsumerSource`; see the module's docstring."""

    consumer: Consumer
    queues_messages: ClassVar[bool] = True
    describes_group: ClassVar[bool] = True
    #: The callbacks run inside consume(), on the fetch thread, and the main thread never calls the
    #: consumer: the engine applies a revoke there and then (see the module's docstring).
    callbacks_may_lock: ClassVar[bool] = True

    @staticmethod
    def size_of(records: Sequence[Any]) -> int:
        return messages_size(records)

    def __init__(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.group = group
        self.topics = list(topics)
        #: Rebalances seen so far (each assignment, even of no partition; on the incremental protocols
        #: each revoke too), and this member's id in the group as of the last: set by the callbacks,
        #: read by the one-database guard.
        self.joins = 0
        self.member_id: str | None = None
        self._admin: Any = None
        #: Asks the brokers for the main thread (see the module's docstring): never subscribes; made
        #: when first needed, and made anew after a failed question (see _ask).
        self._querier: Consumer | None = None
        self._post: OnRebalance | None = None
        #: What the fetch thread is to do to the consumer before its next consume() (under
        #: _wishes_lock): the offset to seek each partition to, and whether to pause (True) or resume it.
        self._want_seek: dict[TP, int] = {}
        self._want_paused: dict[TP, bool] = {}
        self._wishes_lock = threading.Lock()
        #: The partitions the fetch thread last paused (a partition placed again keeps its pause).
        self._paused: set[TP] = set()
        #: The assignment, as the rebalance callbacks made it (under _state_lock).
        self._assigned: set[TP] = set()
        self._state_lock = threading.Lock()
        #: cooperative or consumer: the callbacks name only the partitions added or taken away (set in _connect).
        self._incremental = False
        self._joined = False
        #: Each assigned partition's last known high watermark (see _note_highwaters).
        self._highwaters: dict[TP, int] = {}
        #: Offsets committed to the database, to mirror to Kafka (``mirror_offsets``) on the fetch thread.
        self._mirror: dict[TP, int] = {}
        #: librdkafka's own lines and client-wide errors, quiet (DEBUG) until the broker probe
        #: has answered: an unreachable broker is then one clear line, not librdkafka's retries.
        self._client_log = _ProbeQuietLog()
        self.consumer = self._connect()
        #: Every record's topic when only one is subscribed (records are then grouped by partition number).
        self._topic = self.topics[0] if len(self.topics) == 1 else None

    def _connect(self) -> Consumer:
        s = self.settings
        self._incremental = s.rebalance_protocol != "eager"
        consumer = open_rd_consumer(
            s,
            **{
                "group.id": self.group,
                "client.id": consumer_id(s, self.worker_id),
                # Offsets live in the database: Kafka's are never written by librdkafka
                # (mirror_offsets commits explicitly) and never read (every assignment has an offset).
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # Never move a position by itself (a silent reset skips or repeats records): fail
                # the partition, and kstore places it again itself, loudly (see _fetch).
                "auto.offset.reset": "error",
                "allow.auto.create.topics": False,
                "enable.partition.eof": False,
                "fetch.queue.backoff.ms": s.kafka_options.get("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS),
                **group_protocol(s),
                "max.poll.interval.ms": s.max_poll_interval_ms,
                "error_cb": self._client_log.client_error,
                "on_commit": _mirrored,
                "logger": self._client_log,
            },
        )
        return consumer

    def check_topics(self) -> None:
        known = self._topics_known()
        self._client_log.probed = True
        missing = [t for t in self.topics if t not in known]
        if missing:
            raise ConfigurationError(
                f"unknown topic(s) {', '.join(missing)} at {self.settings.bootstrap_servers}: create them first"
            )

    def _topics_known(self) -> Any:
        """The brokers' topics, asked in attempts of 1 s, 2 s, 4 s... until ``connect_timeout_s`` (so a
        slow answer gets its time); a refused SASL login ends it at once (librdkafka would only time
        out: it says so to its error callback)."""
        deadline, attempt_s = time.monotonic() + self.settings.connect_timeout_s, 1.0
        while True:
            try:
                return self.consumer.list_topics(timeout=max(0.1, min(attempt_s, deadline - time.monotonic()))).topics
            except KafkaException as exc:
                attempt_s *= 2
                self.consumer.poll(0)  # serves the error callback: nothing is subscribed yet
                refused = self._client_log.refused_login
                if refused is not None:
                    raise broker_error(self.settings, "list topics", KafkaException(refused)) from None
                if time.monotonic() >= deadline:
                    raise broker_error(self.settings, "list topics", exc) from None

    def subscribe(self, on_rebalance: OnRebalance) -> None:
        self._post = on_rebalance
        self.consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)

    # -- rebalance callbacks: on the fetch thread, inside consume() ----------------------

    def _on_assign(self, consumer: Consumer, assigned: list[TopicPartition]) -> None:
        # Pause first: no record of a new partition may be fetched before the worker has
        # claimed it and sought to the stored offset. Then assign it at a placeholder (never
        # without an offset: librdkafka would look up Kafka's committed offset), and pause
        # again in case a partition librdkafka did not know yet could not be paused before.
        # Incremental protocols name only the partitions added: those kept are left alone.
        placed = [TopicPartition(tp.topic, tp.partition, PLACEHOLDER_OFFSET) for tp in assigned]
        if placed:
            consumer.pause(placed)
        if self._incremental:
            consumer.incremental_assign(placed)
        else:
            consumer.assign(placed)
        if placed:
            consumer.pause(placed)
        added = {(tp.topic, tp.partition) for tp in assigned}
        self._note_join(consumer.memberid())
        with self._state_lock:
            self._assigned = self._assigned | added if self._incremental else added
            self._joined = True
        # An incremental rebalance that adds nothing here ends with an empty call: reported too (the
        # worker counts the rebalance, and claims nothing).
        self._report("assigned", assigned)

    def _on_revoke(self, consumer: Consumer, revoked: list[TopicPartition]) -> None:
        if self._incremental:  # the group changed, though nothing may be added here (eager: on_assign follows)
            self._note_join(consumer.memberid())
        self._lose("revoked", revoked)
        if self._incremental:
            consumer.incremental_unassign(revoked)
        else:
            consumer.unassign()

    def _on_lost(self, consumer: Consumer, lost: list[TopicPartition]) -> None:
        self._lose("lost", lost)
        if self._incremental:
            consumer.incremental_unassign(lost)
        else:
            consumer.unassign()

    def _lose(self, kind: EventKind, tps: list[TopicPartition]) -> None:
        with self._state_lock:
            if self._incremental:
                # Only those named go; the rest stay assigned and delivered. A revoke leaves the
                # member in the group (the rebalance goes on); a loss means it was not any more.
                self._assigned -= {(tp.topic, tp.partition) for tp in tps}
                if kind == "lost":
                    self._joined = False
            else:
                self._assigned.clear()  # eager: every partition goes, whichever were named
                self._joined = False
        self._report(kind, tps)

    def _note_join(self, member_id: str | None) -> None:
        """A rebalance reached this member (in a callback): count it, note the member id."""
        with self._state_lock:
            self.joins += 1
            self.member_id = member_id or None

    def _report(self, kind: EventKind, tps: list[TopicPartition]) -> None:
        if self._post is not None:
            self._post(kind, [(tp.topic, tp.partition) for tp in tps])

    # -- fetching ---------------------------------------------------------------------

    def fetch(self, timeout_ms: int, max_records: int) -> Fetched:
        self._carry_out()
        # Never more than max_poll_records: kafka-python's polls are bounded by its fetch sizes too,
        # but consume() hands over whatever librdkafka has prefetched (up to 64 MB by default), and
        # one poll's records are what the queues may exceed max_buffered_bytes by.
        most = max(1, min(max_records or self.settings.max_poll_records, self.settings.max_poll_records))
        try:
            # consume(n, timeout) returns only once it has n records or the timeout passed: at a
            # steady rate below n per timeout every record would wait up to the whole timeout. So
            # what librdkafka holds now goes at once; else the wait is for the first record only,
            # and what came with it.
            messages = self.consumer.consume(most, 0)
            if not messages:
                messages = self.consumer.consume(1, timeout_ms / 1000)
                if messages and most > 1:
                    messages += self.consumer.consume(most - 1, 0)
        except KafkaException as exc:
            raise BrokerError(f"consuming from Kafka failed: {describe(exc)}") from exc
        if self.member_id is None:
            # Known once joined, before any assignment: with `consumer` a member given no partition
            # is never called back, and the one-database guard must still tell itself apart.
            self.member_id = self.consumer.memberid() or None
        refused: list[Refused] = []
        if any(map(_is_error, map(Message.error, messages))):
            good = []
            for msg in messages:
                error = msg.error()
                if error is None:
                    good.append(msg)
                else:
                    refused.extend(self._fetch_error(msg, error))
            messages = good
        self._note_highwaters()
        return Fetched(list(by_partition(to_messages(messages, self._topic), self._topic).items()), refused)

    def _fetch_error(self, msg: Message, error: KafkaError) -> list[Refused]:
        """An error librdkafka handed over with the records: a partition it cannot fetch, or news."""
        if error.fatal():
            raise BrokerError(f"the Kafka client failed for good: {error.str()}")
        if error.code() == KafkaError.INCONSISTENT_GROUP_PROTOCOL:
            # Asking again cannot help: the group's members run another protocol (workers of an
            # earlier kstore on kafka-python's eager one, say) and the brokers keep refusing this one.
            raise ConfigurationError(
                f"group {self.group!r} has members on another rebalance protocol than this worker's "
                f"({self.settings.rebalance_protocol}, kafka_client {self.settings.kafka_client}): one group "
                "runs one protocol; stop every worker of the group before changing rebalance_protocol or "
                "kafka_client, or set rebalance_protocol to theirs")
        topic, partition = msg.topic(), msg.partition()
        if error.code() != KafkaError._AUTO_OFFSET_RESET or topic is None or partition is None:
            log.warning("Kafka: %s", error.str())
            return []
        text = str(error.str())
        truncated = (f"the log was truncated below this worker's position ({text}; an unclean leader election?)"
                     if "truncat" in text.lower() else None)
        offset = msg.offset()
        return [Refused((topic, partition), offset if offset is not None and offset >= 0 else None, truncated)]

    def positions(self, tps: Sequence[TP]) -> dict[TP, int]:
        """librdkafka's positions (past the last record returned, transaction markers and aborted
        records included). Fetch thread; no broker call."""
        if not tps:
            return {}
        return {(ktp.topic, ktp.partition): ktp.offset
                for ktp in self.consumer.position([TopicPartition(*tp) for tp in tps]) if ktp.offset >= 0}

    def _note_highwaters(self) -> None:
        """The high watermark each assigned partition's last fetch reported (librdkafka's cache, no
        broker call), kept for :meth:`highwater`, which other threads call. Fetch thread."""
        assigned = self.assignment()
        for tp in assigned:
            try:
                found = self.consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
            except KafkaException:
                continue
            if found is not None and found[1] >= 0:
                self._highwaters[tp] = int(found[1])
        for tp in [tp for tp in self._highwaters if tp not in assigned]:
            del self._highwaters[tp]

    def highwater(self, tp: TP) -> int | None:
        return self._highwaters.get(tp)

    def mirror(self, offsets: Mapping[TP, int]) -> None:
        """Queue committed offsets for :meth:`flush_mirror` (any thread)."""
        with self._wishes_lock:
            self._mirror.update(offsets)

    def flush_mirror(self) -> None:
        with self._wishes_lock:
            offsets, self._mirror = self._mirror, {}
        if not offsets:
            return
        assigned = self.assignment()
        commit = [TopicPartition(tp[0], tp[1], offset, MIRROR_METADATA) for tp, offset in offsets.items()
                  if tp in assigned]
        if commit:
            try:
                self.consumer.commit(offsets=commit, asynchronous=True)
            except KafkaException as exc:
                log.debug("mirroring offsets to Kafka failed (harmless; the next commit mirrors again): %s", exc)

    def group_stable(self) -> bool:
        """Assigned partitions (possibly none) and not revoked since, as the callbacks saw it."""
        with self._state_lock:
            return self._joined

    # -- ownership and position -----------------------------------------------------

    # The engine's seek, pause and resume: wishes (any thread), carried out by the fetch thread
    # before its next consume() (see the module's docstring). The last wish for a partition wins.

    def seek(self, tp: TP, offset: int) -> None:
        with self._wishes_lock:
            self._want_seek[tp] = offset

    def pause(self, tps: Sequence[TP]) -> None:
        with self._wishes_lock:
            self._want_paused.update(dict.fromkeys(tps, True))

    def resume(self, tps: Sequence[TP]) -> None:
        with self._wishes_lock:
            self._want_paused.update(dict.fromkeys(tps, False))

    def release(self, tps: Sequence[TP]) -> None:
        """No seek or resume wished before a partition was dropped may start fetching it again
        before its next claim: forget them, and pause it."""
        with self._wishes_lock:
            for tp in tps:
                self._want_seek.pop(tp, None)
            self._want_paused.update(dict.fromkeys(tps, True))

    def _carry_out(self) -> None:
        """On the fetch thread, before consume(): seek, pause and resume as wished, for partitions
        still assigned. Under the wishes' lock, so a wish made meanwhile waits for these calls."""
        with self._wishes_lock:
            seeks, self._want_seek = self._want_seek, {}
            wanted, self._want_paused = self._want_paused, {}
            if not seeks and not wanted:
                return
            assigned = self.assignment()
            for tp, offset in seeks.items():
                if tp in assigned:
                    self._place(tp, offset, seeks)
            pause = [tp for tp, paused in wanted.items() if paused and tp in assigned]
            resume = [tp for tp, paused in wanted.items() if not paused and tp in assigned]
            if pause:
                self._quietly(self.consumer.pause, [TopicPartition(*tp) for tp in pause], "pausing")
                self._paused.update(pause)
            if resume:
                self._quietly(self.consumer.resume, [TopicPartition(*tp) for tp in resume], "resuming")
                self._paused.difference_update(resume)
            self._paused &= assigned

    def _place(self, tp: TP, offset: int, seeks: Mapping[TP, int]) -> None:
        """Seek; where librdkafka stopped the partition's fetcher (it refuses a seek then), assign
        afresh (``seeks``: the other partitions' offsets sought in the same round). Fetch thread."""
        try:
            self.consumer.seek(TopicPartition(tp[0], tp[1], offset))
        except KafkaException as exc:
            if _code(exc) != KafkaError._STATE:
                log.debug("%s[%d] is no longer assigned: not seeking it (%s)", tp[0], tp[1], describe(exc))
                return
            if self._incremental:
                self._reassign_one(tp, offset)
            else:
                self._reassign(seeks)

    def _reassign_one(self, tp: TP, offset: int) -> None:
        """Incremental protocols: take ``tp`` out of the assignment and put it back at ``offset``
        (``assign()`` would replace the whole assignment). Fetch thread."""
        log.info("placing %s[%d] again at %d (librdkafka stopped fetching it)", tp[0], tp[1], offset)
        ktp = TopicPartition(tp[0], tp[1], offset)
        self.consumer.incremental_unassign([TopicPartition(tp[0], tp[1])])
        self.consumer.incremental_assign([ktp])
        if tp in self._paused:
            self._quietly(self.consumer.pause, [ktp], "pausing")

    def _reassign(self, seeks: Mapping[TP, int]) -> None:
        """Assign the whole assignment again where each partition is read (sought now, else
        librdkafka's position, else the placeholder), keeping paused what was. Fetch thread."""
        current = sorted(self.assignment())
        if not current:
            return
        known = self.positions(current)
        placed = [TopicPartition(t, p, seeks.get((t, p), known.get((t, p), PLACEHOLDER_OFFSET))) for t, p in current]
        log.info("placing %d partition(s) again (librdkafka stopped fetching one)", len(placed))
        self.consumer.assign(placed)
        idle = [TopicPartition(*tp) for tp in current if tp in self._paused]
        if idle:
            self._quietly(self.consumer.pause, idle, "pausing")

    @staticmethod
    def _quietly(call: Any, ktps: list[TopicPartition], doing: str) -> None:
        try:
            call(ktps)
        except KafkaException as exc:  # not assigned any more: its revoke event follows
            log.debug("not %s %d partition(s): %s", doing, len(ktps), describe(exc))

    def assignment(self) -> set[TP]:
        with self._state_lock:
            return set(self._assigned)

    def _ask(self, what: str, question: Callable[[Consumer], _T]) -> _T:
        """``question`` asked of the querier. Main thread. A handle that failed is closed and made
        anew for the next question: one made before the group's coordinator broker died was seen to
        answer "Unknown partition" for good, so a worker whose claim needs the log bounds never claimed."""
        if self._querier is None:
            s = self.settings
            self._querier = Consumer({**librdkafka_config(s), "group.id": f"{self.group}.kstore-queries",
                                      "enable.auto.commit": False, "client.id": f"{consumer_id(s, self.worker_id)}-q",
                                      "logger": self._client_log})
        try:
            return question(self._querier)
        except KafkaException as exc:
            self._close_querier()
            raise BrokerError(f"cannot {what}: {describe(exc)}") from exc

    def _close_querier(self) -> None:
        querier, self._querier = self._querier, None
        if querier is not None:
            querier.close()

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        def ask(querier: Consumer) -> dict[TP, tuple[int, int]]:
            bounds: dict[TP, tuple[int, int]] = {}
            for tp in tps:
                found = querier.get_watermark_offsets(TopicPartition(*tp), timeout=REQUEST_TIMEOUT_S)
                if found is None:
                    raise BrokerError(f"cannot read the log bounds of {tp[0]}[{tp[1]}]: no answer")
                bounds[tp] = (int(found[0]), int(found[1]))
            return bounds

        return self._ask(f"read the log bounds of {len(tps)} partition(s)", ask)

    def offsets_for_times(self, targets: dict[TP, datetime]) -> dict[TP, int | None]:
        if not targets:
            return {}
        query = [TopicPartition(tp[0], tp[1], int(when.timestamp() * 1000)) for tp, when in targets.items()]
        found = self._ask("look up offsets by time", lambda q: q.offsets_for_times(query, timeout=REQUEST_TIMEOUT_S))
        return {(k.topic, k.partition): (k.offset if k.offset >= 0 else None) for k in found}

    def group_members(self) -> GroupView:
        """The group's live members, through confluent-kafka's admin client (a handle of its own, never
        the group's consumer): a classic group's and a ``consumer``-protocol group's alike."""
        if self._admin is None:
            config = {k: v for k, v in librdkafka_config(self.settings).items() if k != "isolation.level"}
            self._admin = AdminClient({**config, "logger": _DebugLog()})  # type: ignore[dict-item]
        try:
            described = self._admin.describe_consumer_groups(
                [self.group], request_timeout=self.settings.connect_timeout_s)[self.group].result()
        except KafkaException as exc:
            # An admin handle made before a broker restarted was seen never to answer again (every
            # describe timed out): the next attempt makes a new one.
            self._admin = None
            raise broker_error(self.settings, f"describe group {self.group!r}", exc) from None
        return GroupView(tuple(GroupMember(m.member_id, m.client_id) for m in described.members),
                         described.state == ConsumerGroupState.STABLE)

    def close(self) -> None:
        """Leave the group; nothing is committed to Kafka (auto-commit is off)."""
        try:
            self.consumer.close()
        finally:
            self._close_querier()
            self._admin = None  # confluent-kafka's AdminClient has no close: its handle goes with it


def group_protocol(settings: Settings) -> dict[str, Any]:
    """librdkafka's group settings for ``settings.rebalance_protocol``.

    eager: the classic protocol, assignor ``range``, the protocol name kafka-python's workers use,
    so a group may mix both backends. cooperative: the classic protocol, ``cooperative-sticky``
    (a group cannot mix it with eager members: change it by restarting every worker). consumer:
    KIP-848; the broker assigns (its ``group.remote.assignor``) and owns the session timeout and the
    heartbeat interval (``group.consumer.session.timeout.ms``, ``group.consumer.heartbeat.interval.ms``
    or the group's own configs): librdkafka refuses them on the client."""
    protocol = settings.rebalance_protocol
    if protocol == "consumer":
        return {"group.protocol": "consumer"}
    return {"partition.assignment.strategy": "cooperative-sticky" if protocol == "cooperative" else "range",
            "session.timeout.ms": settings.session_timeout_ms,
            "heartbeat.interval.ms": settings.heartbeat_interval_ms}


def consumer_id(settings: Settings, worker_id: str) -> str:
    """The consumer's client id: the worker's own name (kstore.relay.member.member_name), as on
    kafka-python, so ``offsets show`` and ``top`` spell a live owner as the worker's log does."""
    return str(settings.client_id or worker_id)


def _code(exc: KafkaException) -> Any:
    error = exc.args[0] if exc.args else None
    return error.code() if isinstance(error, KafkaError) else None


class _DebugLog:
    """The ``logger`` of the admin client: its lines (a consumer option it ignores, say) at DEBUG."""

    def log(self, _level: int, msg: str, *args: Any) -> None:
        logging.getLogger("kstore.kafka.librdkafka").debug(msg, *args)


class _ProbeQuietLog:
    """The ``logger`` and ``error_cb`` a ConfluentSource gives librdkafka: its lines go to
    ``kstore.kafka.librdkafka`` and its client-wide errors (a broker down, all brokers down: it
    retries by itself) to ``kstore.kafka.kafkapython.consumer`` as WARNINGs, both at DEBUG until ``probed``."""

    def __init__(self) -> None:
        self.probed = False
        #: The brokers refused the SASL login (librdkafka tries again; the worker need not).
        self.refused_login: KafkaError | None = None
        self._lines = logging.getLogger("kstore.kafka.librdkafka")

    def log(self, level: int, msg: str, *args: Any) -> None:
        self._lines.log(level if self.probed else logging.DEBUG, msg, *args)

    def client_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._AUTHENTICATION:
            self.refused_login = error
        log.log(logging.WARNING if self.probed else logging.DEBUG, "Kafka client: %s", error.str())


def _mirrored(error: KafkaError | None, _partitions: list[TopicPartition]) -> None:
    """A mirror commit's answer: a failure (a rebalance under way) is only logged; the next commit mirrors again."""
    if error is not None:
        log.debug("mirroring offsets to Kafka failed (harmless; the next commit mirrors again): %s", error.str())
