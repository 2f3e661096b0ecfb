"""The operator's questions to the brokers on kafka-python (:class:`~kstore.kafka.seam.AdminReader`):
a topic's partitions, log bounds, offsets by time, a group's live members and committed offsets,
the record at an offset, topics' partition counts and creating the missing ones.

A group-less consumer (assigned the partitions it reads, small fetches) answers the partition
questions, a :class:`KafkaAdminClient` the group and topic ones; each is made at the first question
that needs it. Any kafka-python error comes out as :class:`~kstore.errors.BrokerError`, one line,
after asking again while it is transient (:mod:`kstore.kafka.asking`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from kafka import OffsetAndMetadata, TopicPartition
from kafka.errors import (
    BrokerResponseError,
    KafkaError,
    KafkaTimeoutError,
    NoError,
    NotCoordinatorError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)

from kstore.errors import BrokerError
from kstore.kafka.asking import Asker, Failure
from kstore.kafka.seam import Committed, GroupView, committed_metadata, offsets_refused, tail_value
from kstore.settings import Settings
from kstore.types import TopicPartition as TP

from .connect import client_config, open_admin, open_consumer
from .members import group_error, view_of

log = logging.getLogger(__name__)

#: The reader's consumer fetches one record per partition: small fetches (the broker still
#: returns the whole first record batch, whatever its size).
_FETCH_CONFIG = {"max_poll_records": 1, "max_partition_fetch_bytes": 16384, "fetch_max_bytes": 65536,
                 "fetch_max_wait_ms": 100}
#: How long to wait for a created topic to have a leader for every partition.
CREATED_WAIT_MS = 30_000


class KafkaPythonAdmin:
    """kafka-python's :class:`~kstore.kafka.seam.AdminReader`. ``request_timeout_s`` bounds each request
    (kafka-python's default otherwise), ``patience_s`` how long transient answers are asked again."""

    def __init__(self, settings: Settings, *, request_timeout_s: float | None = None, patience_s: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        client_config(settings)  # TLS files, a token provider: a mistake is named now, not at the first question
        self.settings = settings
        self._request_timeout = ({} if request_timeout_s is None
                                 else {"request_timeout_ms": int(request_timeout_s * 1000)})
        patience = settings.connect_timeout_s if patience_s is None else patience_s
        self._ask = Asker(settings.bootstrap_servers, patience, _failure, sleep=sleep, clock=clock)
        self._consumer: Any = None
        self._tail_consumer: Any = None
        self._admin: Any = None

    # -- the clients, made when first needed ------------------------------------------------------

    def _reader(self) -> Any:
        if self._consumer is None:
            # Assigned partitions, no group. An offset deleted by retention since it was asked for
            # reads from the log start.
            self._consumer = open_consumer(self.settings, group_id=None, enable_auto_commit=False,
                                           allow_auto_create_topics=False, auto_offset_reset="earliest",
                                           **self._request_timeout, **_FETCH_CONFIG)
        return self._consumer

    def _tail_reader(self) -> Any:
        """A consumer for :meth:`last_values`: always ``read_committed``, whatever the Kafka options say."""
        if self._tail_consumer is None:
            self._tail_consumer = open_consumer(self.settings, group_id=None, enable_auto_commit=False,
                                                allow_auto_create_topics=False, isolation_level="read_committed",
                                                fetch_max_wait_ms=100, **self._request_timeout)
        return self._tail_consumer

    def _admin_client(self) -> Any:
        if self._admin is None:
            self._admin = open_admin(self.settings)
        return self._admin

    def _forget_admin(self, exc: Exception) -> None:
        """kafka-python keeps the coordinator it found and has no way to forget it: a new admin
        client looks it up again."""
        if isinstance(exc, NotCoordinatorError) and self._admin is not None:
            self._admin.close()
            self._admin = None

    def connect(self) -> None:
        self._reader()
        self._admin_client()

    # -- partitions -------------------------------------------------------------------------------

    def partitions(self, topic: str) -> list[int]:
        found = self._ask(f"list the partitions of {topic!r}", lambda: self._reader().partitions_for_topic(topic))
        return sorted(found or ())

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        def bounds() -> dict[TP, tuple[int, int]]:
            ktps = [TopicPartition(*tp) for tp in tps]
            if not ktps:
                return {}
            starts = self._reader().beginning_offsets(ktps)
            ends = self._reader().end_offsets(ktps)
            return {(k.topic, k.partition): (starts[k], ends[k]) for k in ktps}
        return self._ask(f"read the log bounds of {len(tps)} partition(s)", bounds)

    def offsets_for_times(self, targets: Mapping[TP, datetime]) -> dict[TP, int | None]:
        def look_up() -> dict[TP, int | None]:
            query = {TopicPartition(*tp): int(when.timestamp() * 1000) for tp, when in targets.items()}
            found = self._reader().offsets_for_times(query) if query else {}
            return {(k.topic, k.partition): (v.offset if v is not None else None) for k, v in found.items()}
        return self._ask("look up offsets by time", look_up)

    def first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        return self._ask(f"read {len(offsets)} record(s)", lambda: self._first_timestamps(offsets, timeout_s))

    def _first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        consumer = self._reader()
        ktps = {TopicPartition(*tp): offset for tp, offset in offsets.items()}
        consumer.assign(list(ktps))
        for ktp, offset in ktps.items():
            consumer.seek(ktp, offset)
        found: dict[TP, int | None] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(found) < len(ktps) and (left := deadline - time.monotonic()) > 0:
                for ktp, records in consumer.poll(timeout_ms=max(1, int(left * 1000))).items():
                    if records and (ktp.topic, ktp.partition) not in found:
                        stamp = records[0].timestamp
                        found[(ktp.topic, ktp.partition)] = stamp if stamp is not None and stamp >= 0 else None
                    consumer.pause(ktp)  # one record is all it needs: fetch no more of this partition
        finally:
            consumer.unsubscribe()
        return found

    def last_values(self, tps: Sequence[TP], timeout_s: float) -> dict[TP, bytes | None]:
        return self._ask(f"read the last record of {len(tps)} partition(s)", lambda: self._last_values(tps, timeout_s))

    def _last_values(self, tps: Sequence[TP], timeout_s: float) -> dict[TP, bytes | None]:
        consumer, deadline = self._tail_reader(), time.monotonic() + timeout_s

        def read(tp: TP, first: int, end: int) -> list[bytes | None]:
            ktp = TopicPartition(*tp)
            consumer.assign([ktp])
            consumer.seek(ktp, first)
            values: list[bytes | None] = []
            try:
                # The position moves past aborted records and transaction markers too.
                while consumer.position(ktp) < end:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise KafkaTimeoutError(f"{tp[0]}[{tp[1]}] not read in {timeout_s:g}s")
                    for records in consumer.poll(timeout_ms=max(1, int(min(left, 1.0) * 1000))).values():
                        values.extend(r.value for r in records if r.offset < end)
            finally:
                consumer.unsubscribe()
            return values

        found: dict[TP, bytes | None] = {}
        for tp in tps:
            ktp = TopicPartition(*tp)
            bounds = (consumer.beginning_offsets([ktp])[ktp], consumer.end_offsets([ktp])[ktp])
            found[tp] = tail_value(tp, bounds, read)
        return found

    # -- groups -----------------------------------------------------------------------------------

    def group_view(self, group: str) -> GroupView:
        return self._ask(f"describe group {group!r}", lambda: self._describe(group), self._forget_admin)

    def _describe(self, group: str) -> GroupView:
        described: dict[str, Any] = self._admin_client().describe_groups([group]).get(group, {})
        # kafka-python gives a group's own error (its coordinator still loading, say) as text in the
        # answer, not raised: a transient one is raised here, to be asked again. Any other (no such
        # group) leaves a group with no live member.
        error = group_error(described.get("error"))
        if error is not None and error.retriable:
            raise error(described["error"])
        if error is not None:
            log.debug("describing group %r: %s", group, described["error"])
            return GroupView((), False)
        return view_of(described)

    def committed(self, group: str) -> dict[TP, Committed]:
        def read() -> dict[TP, Committed]:
            found = self._admin_client().list_group_offsets({group: None}).get(group, {})
            return {(k.topic, k.partition): Committed(om.offset, committed_metadata(om)) for k, om in found.items()}
        return self._ask(f"read the committed offsets of group {group!r}", read, self._forget_admin)

    def commit(self, group: str, offsets: Mapping[TP, int], metadata: str) -> None:
        new = {TopicPartition(*tp): OffsetAndMetadata(offset, metadata, -1) for tp, offset in offsets.items()}
        answers = self._ask(f"commit the offsets of group {group!r}",
                            lambda: self._admin_client().alter_group_offsets(group, new), self._forget_admin)
        refused = sorted({_reason(error()) for error in answers.values() if error is not NoError})
        if refused:
            raise offsets_refused(self.settings.bootstrap_servers, group, ", ".join(refused))

    # -- topics -----------------------------------------------------------------------------------

    def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        return self._ask(f"describe {len(topics)} topic(s)", lambda: self._counts(topics))

    def _counts(self, topics: Sequence[str]) -> dict[str, int]:
        described = {d.get("name"): d for d in self._admin_client().describe_topics(list(topics))} if topics else {}
        counts = {}
        for topic in topics:
            entry = described.get(topic)
            if entry is None or entry.get("error_code") == UnknownTopicOrPartitionError.errno:
                counts[topic] = 0
            elif entry.get("error_code"):
                raise BrokerError(f"Kafka at {self.settings.bootstrap_servers} could not describe topic {topic!r}: "
                                  f"error {entry['error_code']}")
            else:
                counts[topic] = len(entry.get("partitions") or ())
        return counts

    def create_missing(self, topics: Sequence[str], partitions: int | None, replication_factor: int | None,
                       config: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, int]]:
        missing = [t for t, n in self.partition_counts(topics).items() if n == 0]
        if missing:
            spec = {t: {"num_partitions": partitions or -1, "replication_factor": replication_factor or -1,
                        "configs": dict(config or {})} for t in missing}
            answer = self._ask("create topics", lambda: self._admin_client().create_topics(spec, raise_errors=False))
            refused = [(t["name"], t.get("error_message") or t["error_code"]) for t in answer.get("topics", [])
                       if t.get("error_code") not in (0, TopicAlreadyExistsError.errno)]
            if refused:
                raise BrokerError(f"Kafka at {self.settings.bootstrap_servers} refused to create "
                                  + "; ".join(f"{name!r}: {why}" for name, why in refused))
            self._ask("wait for the new topics' leaders",
                      lambda: self._admin_client().wait_for_topics(missing, timeout_ms=CREATED_WAIT_MS))
        return missing, self.partition_counts(topics)

    def add_partitions(self, topic: str, total: int) -> None:
        self._ask(f"add partitions to {topic!r}", lambda: self._admin_client().create_partitions({topic: total}))
        self._ask("wait for the new partitions' leaders",
                  lambda: self._admin_client().wait_for_topics([topic], timeout_ms=CREATED_WAIT_MS))

    def close(self) -> None:
        """Close both clients (after an outage too: nothing to save); the next question opens them again."""
        consumer, tail, admin = self._consumer, self._tail_consumer, self._admin
        self._consumer = self._tail_consumer = self._admin = None
        closers: list[Callable[[], None]] = []
        for each in (consumer, tail):
            if each is not None:
                closers.append(functools.partial(each.close, autocommit=False))
        if admin is not None:
            closers.append(admin.close)
        for close in closers:
            try:
                close()
            except Exception:  # closing after an outage: nothing to save
                log.debug("closing a Kafka client failed", exc_info=True)


def _failure(exc: Exception) -> Failure | None:
    if not isinstance(exc, KafkaError):
        return None
    return Failure(_reason(exc), bool(exc.retriable))


def _reason(exc: KafkaError) -> str:
    """The broker's name for an error (``COORDINATOR_NOT_AVAILABLE``), or the client's first line."""
    if isinstance(exc, BrokerResponseError) and exc.message:
        return str(exc.message)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
