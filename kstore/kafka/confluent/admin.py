"""The operator's questions to the brokers on confluent-kafka (:class:`~kstore.kafka.seam.AdminReader`):
the same answers as kafka-python's (:mod:`kstore.kafka.kafkapython.admin`), through librdkafka.

An ``AdminClient`` answers the topic, offset and group questions (``list_offsets`` reads log bounds
and offsets by time for every partition in one request); a consumer that joins no group (assigned
the partitions it reads) fetches the one record whose timestamp lag needs. Each is made at the first
question that needs it. Any error comes out as :class:`~kstore.errors.BrokerError`, one line, after
asking again while it is transient (:mod:`kstore.kafka.asking`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from confluent_kafka import (
    Consumer,
    ConsumerGroupState,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic, OffsetSpec  # type: ignore[attr-defined]  # not in its __all__

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.asking import Asker, Failure
from kstore.kafka.options import DEFAULT_ISOLATION_LEVEL
from kstore.kafka.seam import Committed, GroupMember, GroupView, committed_metadata, offsets_refused, tail_value
from kstore.kafka.security import probe_config
from kstore.settings import Settings
from kstore.types import TopicPartition as TP

from .connect import checked_config, client_config, describe

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long to wait for a created topic to have a leader for every partition.
CREATED_WAIT_S = 30.0
#: Each request's timeout when none is given: librdkafka's own default for admin requests.
REQUEST_TIMEOUT_S = 30.0
#: Answers asked again, as transient, besides those librdkafka marks retriable: brokers away or slow, a
#: group coordinator not there yet, a transaction's offsets not settled yet, a partition's leader not
#: ready yet (a topic just created: its log bounds were answered NOT_LEADER_FOR_PARTITION, not retriable,
#: about one time in three).
_TRANSIENT = (KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._WAIT_COORD,
              KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
              KafkaError.NOT_COORDINATOR, KafkaError.UNSTABLE_OFFSET_COMMIT, KafkaError.NOT_LEADER_FOR_PARTITION,
              KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.FENCED_LEADER_EPOCH)


#: Answers after which the next question makes a new AdminClient: no broker answered, or the handle's
#: idea of a partition's leader is stale (after a broker restarted, a relay's handle was seen to answer
#: FENCED_LEADER_EPOCH to every question for minutes).
_REMAKE_ON = (KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError.FENCED_LEADER_EPOCH,
              KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)


class ConfluentAdmin:
    """confluent-kafka's :class:`~kstore.kafka.seam.AdminReader`. ``request_timeout_s`` bounds each request,
    ``patience_s`` how long transient answers are asked again (``connect_timeout_s`` unless given)."""

    def __init__(self, settings: Settings, *, request_timeout_s: float | None = None, patience_s: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        probe_config(settings)  # TLS files, a token provider: a mistake is named now, not at the first question
        self._config = client_config(settings)
        self._timeout = request_timeout_s or min(REQUEST_TIMEOUT_S, max(1.0, settings.connect_timeout_s))
        patience = settings.connect_timeout_s if patience_s is None else patience_s
        self._ask = Asker(settings.bootstrap_servers, patience, _failure, sleep=sleep, clock=clock)
        self._admin: AdminClient | None = None
        self._consumer: Consumer | None = None
        self._tail_consumer: Consumer | None = None
        #: The brokers refused the SASL login: librdkafka says so to its error callback only, and its
        #: requests time out; the next failed request says why instead.
        self._refused_login: KafkaError | None = None

    # -- the clients, made when first needed ------------------------------------------------------

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            config = {k: v for k, v in checked_config(self.settings, self._config).items() if k != "isolation.level"}
            callbacks: dict[str, Any] = {"logger": _DebugLog(), "error_cb": self._on_error}
            self._admin = _made(lambda: AdminClient({**config, **callbacks}))
        return self._admin

    def _on_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._AUTHENTICATION:
            self._refused_login = error

    def _reader(self) -> Consumer:
        if self._consumer is None:
            # No group is joined (assign() only, nothing committed): the id is librdkafka's requirement.
            config = {**checked_config(self.settings, self._config), "group.id": "kstore-admin",
                      "enable.auto.commit": False, "enable.auto.offset.store": False,
                      "auto.offset.reset": "earliest", "allow.auto.create.topics": False,
                      "isolation.level": DEFAULT_ISOLATION_LEVEL,
                      # Small fetches, a little read ahead: one record of each partition is all it reads.
                      "max.partition.fetch.bytes": 16384, "queued.min.messages": 1,
                      "queued.max.messages.kbytes": 1024, "fetch.wait.max.ms": 100, "logger": _DebugLog()}
            self._consumer = _made(lambda: Consumer(config))
        return self._consumer

    def _tail_reader(self) -> Consumer:
        """A consumer for :meth:`last_values`: always ``read_committed`` (whatever the Kafka options say),
        and told when it has read up to a partition's end."""
        if self._tail_consumer is None:
            config = {**checked_config(self.settings, self._config), "group.id": "kstore-admin",
                      "enable.auto.commit": False, "enable.auto.offset.store": False,
                      "allow.auto.create.topics": False, "isolation.level": "read_committed",
                      "enable.partition.eof": True, "fetch.wait.max.ms": 100, "logger": _DebugLog()}
            self._tail_consumer = _made(lambda: Consumer(config))
        return self._tail_consumer

    def _wait(self, future: concurrent.futures.Future[_T]) -> _T:
        """A request's answer; one that does not come within twice its timeout counts as the brokers away.

        After a timeout the next question makes a new AdminClient: one made before a broker restarted
        was seen never to answer again (every request timed out while a new handle was answered)."""
        deadline = time.monotonic() + 2 * self._timeout
        # In slices: a refused login (said to the error callback, served by poll) ends the wait.
        while not future.done() and time.monotonic() < deadline and self._refused_login is None:
            concurrent.futures.wait([future], timeout=0.2)
            if self._admin is not None:
                self._admin.poll(0)
        if not future.done():
            self._gone()
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer in time"))
        try:
            return future.result()
        except KafkaException as exc:
            if _code(exc) in _REMAKE_ON:
                self._gone()
            raise

    def _gone(self) -> None:
        """A request found no broker: a refused login is why (not asked again), or the handle is made anew."""
        admin, self._admin = self._admin, None
        if admin is not None:
            admin.poll(0)  # serves the error callback
        if self._refused_login is not None:
            raise KafkaException(self._refused_login)

    def connect(self) -> None:
        self._admin_client()

    # -- partitions -------------------------------------------------------------------------------

    def partitions(self, topic: str) -> list[int]:
        return sorted(range(self.partition_counts([topic])[topic]))

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        if not tps:
            return {}
        what = f"read the log bounds of {len(tps)} partition(s)"
        starts = self._list_offsets(what, dict.fromkeys(tps, OffsetSpec.earliest()))  # type: ignore[no-untyped-call]
        ends = self._list_offsets(what, dict.fromkeys(tps, OffsetSpec.latest()))  # type: ignore[no-untyped-call]
        return {tp: (starts[tp], ends[tp]) for tp in tps}

    def offsets_for_times(self, targets: Mapping[TP, datetime]) -> dict[TP, int | None]:
        if not targets:
            return {}
        found = self._list_offsets("look up offsets by time", {
            tp: OffsetSpec.for_timestamp(int(when.timestamp() * 1000)) for tp, when in targets.items()})
        return {tp: offset if offset >= 0 else None for tp, offset in found.items()}

    def _list_offsets(self, what: str, specs: Mapping[TP, Any], committed: bool | None = None) -> dict[TP, int]:
        if committed is None:
            committed = DEFAULT_ISOLATION_LEVEL == "read_committed"
        isolation = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED

        def ask() -> dict[TP, int]:
            futures = self._admin_client().list_offsets({TopicPartition(*tp): spec for tp, spec in specs.items()},
                                                        isolation_level=isolation, request_timeout=self._timeout)
            return {(k.topic, k.partition): int(self._wait(f).offset) for k, f in futures.items()}
        return self._ask(what, ask)

    def first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        return self._ask(f"read {len(offsets)} record(s)", lambda: self._first_timestamps(offsets, timeout_s))

    def _first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        consumer = self._reader()
        consumer.assign([TopicPartition(tp[0], tp[1], offset) for tp, offset in offsets.items()])
        found: dict[TP, int | None] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(found) < len(offsets) and (left := deadline - time.monotonic()) > 0:
                for msg in consumer.consume(num_messages=len(offsets), timeout=min(left, 1.0)):
                    error = msg.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            continue
                        raise KafkaException(error)
                    tp = (str(msg.topic()), int(msg.partition() or 0))
                    if tp not in found:
                        kind, stamp = msg.timestamp()
                        found[tp] = stamp if kind != 0 and stamp >= 0 else None  # 0: TIMESTAMP_NOT_AVAILABLE
                        # One record is all it needs: fetch no more of this partition.
                        consumer.pause([TopicPartition(*tp)])
        finally:
            consumer.unassign()
        return found

    def last_values(self, tps: Sequence[TP], timeout_s: float) -> dict[TP, bytes | None]:
        return self._ask(f"read the last record of {len(tps)} partition(s)", lambda: self._last_values(tps, timeout_s))

    def _last_values(self, tps: Sequence[TP], timeout_s: float) -> dict[TP, bytes | None]:
        consumer, deadline = self._tail_reader(), time.monotonic() + timeout_s

        def read(tp: TP, first: int, end: int) -> list[bytes | None]:
            consumer.assign([TopicPartition(tp[0], tp[1], first)])
            values: list[bytes | None] = []
            try:
                while (left := deadline - time.monotonic()) > 0:
                    for msg in consumer.consume(num_messages=500, timeout=min(left, 1.0)):
                        error = msg.error()
                        if error is not None:
                            if error.code() == KafkaError._PARTITION_EOF:
                                return values
                            raise KafkaException(error)
                        offset = msg.offset() or 0
                        if offset < end:
                            values.append(msg.value())
                        if offset >= end - 1:
                            return values
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"{tp[0]}[{tp[1]}] not read in {timeout_s:g}s"))
            finally:
                consumer.unassign()

        # Asked of the AdminClient, which fetches the topic's metadata for the question: the consumer
        # knows only the topics it was assigned before (a progress topic made since is unknown to it).
        what = f"read the log bounds of {len(tps)} partition(s)"
        starts = self._list_offsets(what, dict.fromkeys(tps, OffsetSpec.earliest()), committed=True)  # type: ignore[no-untyped-call]
        ends = self._list_offsets(what, dict.fromkeys(tps, OffsetSpec.latest()), committed=True)  # type: ignore[no-untyped-call]
        return {tp: tail_value(tp, (starts[tp], ends[tp]), read) for tp in tps}

    # -- groups -----------------------------------------------------------------------------------

    def group_view(self, group: str) -> GroupView:
        def ask() -> GroupView:
            described = self._describe(group)
            if described is None:
                return GroupView((), False)
            members = tuple(GroupMember(m.member_id, m.client_id or "", None, _assigned(m.assignment))
                            for m in described.members)
            return GroupView(members, described.state == ConsumerGroupState.STABLE)
        return self._ask(f"describe group {group!r}", ask)

    def _describe(self, group: str) -> Any:
        """The group as its coordinator describes it, None for a group it does not know."""
        future = self._admin_client().describe_consumer_groups([group], request_timeout=self._timeout)[group]
        try:
            return self._wait(future)
        except KafkaException as exc:
            if _code(exc) == KafkaError.GROUP_ID_NOT_FOUND:
                return None
            raise

    def committed(self, group: str) -> dict[TP, Committed]:
        def ask() -> dict[TP, Committed]:
            # librdkafka's admin client crashes the process (SIGSEGV, librdkafka #5040) when an
            # OffsetFetch answer says the coordinator is not there yet, as on a broker just started.
            # Describing the group first finds its coordinator and fails cleanly (asked again) until then.
            self._describe(group)
            # Stable offsets only: while a transaction that commits offsets for the group is open, the
            # brokers answer UNSTABLE_OFFSET_COMMIT (asked again) rather than an offset it may still change.
            request = [ConsumerGroupTopicPartitions(group)]
            found = self._wait(self._admin_client().list_consumer_group_offsets(
                request, require_stable=True, request_timeout=self._timeout)[group])
            return {(k.topic, k.partition): Committed(k.offset, _metadata(k))
                    for k in found.topic_partitions or () if k.offset >= 0}
        return self._ask(f"read the committed offsets of group {group!r}", ask)

    def commit(self, group: str, offsets: Mapping[TP, int], metadata: str) -> None:
        def ask() -> Any:
            request = [ConsumerGroupTopicPartitions(
                group, [TopicPartition(tp[0], tp[1], offset, metadata) for tp, offset in offsets.items()])]
            return self._wait(self._admin_client().alter_consumer_group_offsets(
                request, request_timeout=self._timeout)[group])
        try:
            answer = self._ask(f"commit the offsets of group {group!r}", ask)
        except BrokerError as exc:
            # Kafka takes no offsets from outside a live group: a member joined since the caller looked.
            raise offsets_refused(self.settings.bootstrap_servers, group, str(exc).rpartition(": ")[2]) from None
        refused = sorted({k.error.name() for k in answer.topic_partitions or () if k.error is not None})
        if refused:
            raise offsets_refused(self.settings.bootstrap_servers, group, ", ".join(refused))

    # -- topics -----------------------------------------------------------------------------------

    def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        return self._ask(f"describe {len(topics)} topic(s)", lambda: self._counts(topics))

    def _counts(self, topics: Sequence[str]) -> dict[str, int]:
        if not topics:
            return {}
        futures = self._admin_client().describe_topics(TopicCollection(list(topics)), request_timeout=self._timeout)
        counts = {}
        for topic, future in futures.items():
            try:
                counts[topic] = len(self._wait(future).partitions)
            except KafkaException as exc:
                if _code(exc) != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise
                counts[topic] = 0
        return {topic: counts[topic] for topic in topics}

    def create_missing(self, topics: Sequence[str], partitions: int | None, replication_factor: int | None,
                       config: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, int]]:
        missing = [t for t, n in self.partition_counts(topics).items() if n == 0]
        if missing:
            futures = self._ask("create topics", lambda: self._admin_client().create_topics(
                [NewTopic(t, num_partitions=partitions or -1, replication_factor=replication_factor or -1,
                          config=dict(config or {})) for t in missing], request_timeout=self._timeout))
            refused = []
            for topic, future in futures.items():
                try:
                    self._wait(future)
                except KafkaException as exc:
                    if _code(exc) != KafkaError.TOPIC_ALREADY_EXISTS:
                        refused.append((topic, describe(exc)))
            if refused:
                raise BrokerError(f"Kafka at {self.settings.bootstrap_servers} refused to create "
                                  + "; ".join(f"{name!r}: {why}" for name, why in refused))
            self._wait_for_leaders(missing)
        return missing, self.partition_counts(topics)

    def add_partitions(self, topic: str, total: int) -> None:
        futures = self._ask(f"add partitions to {topic!r}", lambda: self._admin_client().create_partitions(
            [NewPartitions(topic, total)], request_timeout=self._timeout))
        for future in futures.values():
            self._wait(future)
        self._wait_for_leaders([topic])

    def _wait_for_leaders(self, topics: Sequence[str]) -> None:
        deadline = time.monotonic() + CREATED_WAIT_S
        while True:
            futures = self._admin_client().describe_topics(TopicCollection(list(topics)), request_timeout=self._timeout)
            try:
                if all(p.leader is not None for f in futures.values() for p in self._wait(f).partitions):
                    return
            except KafkaException as exc:
                if _code(exc) != KafkaError.UNKNOWN_TOPIC_OR_PART:  # not known everywhere yet
                    raise
            if time.monotonic() > deadline:
                raise BrokerError(f"Kafka at {self.settings.bootstrap_servers}: the new topics "
                                  f"{', '.join(topics)} have no leaders after {CREATED_WAIT_S:g}s")
            time.sleep(0.1)

    def close(self) -> None:
        """Close the consumer (after an outage too: nothing to save); the next question opens them again."""
        consumers = (self._consumer, self._tail_consumer)
        self._consumer = self._tail_consumer = None
        self._admin = None  # confluent-kafka's AdminClient has no close: its handle goes with it
        for consumer in consumers:
            if consumer is None:
                continue
            try:
                consumer.close()
            except Exception:  # closing after an outage: nothing to save
                log.debug("closing a Kafka client failed", exc_info=True)


def _metadata(committed: TopicPartition) -> str:
    """A committed offset's metadata; confluent-kafka reads one that does not end in a NUL past its end
    (see :func:`kstore.relay.progress.highest_mark`), which may not even decode: then none."""
    try:
        return committed_metadata(committed)
    except UnicodeDecodeError:
        return ""


def _assigned(assignment: Any) -> tuple[TP, ...]:
    partitions = getattr(assignment, "topic_partitions", None) or ()
    return tuple((p.topic, p.partition) for p in partitions)


def _made(make: Callable[[], _T]) -> _T:
    try:
        return make()
    except KafkaException as exc:
        raise ConfigurationError(f"Kafka client configuration: {describe(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"Kafka client configuration: {exc}") from None


def _code(exc: KafkaException) -> Any:
    error = exc.args[0] if exc.args else None
    return error.code() if isinstance(error, KafkaError) else None


def _failure(exc: Exception) -> Failure | None:
    if not isinstance(exc, KafkaException):
        return None
    error = exc.args[0] if exc.args else None
    if not isinstance(error, KafkaError):
        return Failure(describe(exc), False)
    # The brokers' name for an error they answered (COORDINATOR_NOT_AVAILABLE), librdkafka's sentence
    # for its own (the brokers away).
    reason = error.name() if error.code() >= 0 else describe(exc)
    return Failure(reason, bool(error.retriable() or error.code() in _TRANSIENT))


class _DebugLog:
    """The ``logger`` of the admin clients: librdkafka's lines (a broker away: it retries by itself) at DEBUG."""

    def log(self, _level: int, msg: str, *args: Any) -> None:
        logging.getLogger("kstore.kafka.librdkafka").debug(msg, *args)
