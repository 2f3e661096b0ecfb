"""Reading partitions from the brokers with no group and no worker: their log bounds, the record at an
offset, and the live members that own them. Read-only, for :mod:`kstore.ops.lag`.

The consumer is assigned the partitions it reads (no group) and fetches one record of each,
in small fetches. Any kafka-python error comes out as :class:`~kstore.errors.BrokerError`
(``Kafka at HOST: ...``, one line), so that the caller needs no kafka-python of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaError, UnknownTopicOrPartitionError

from kstore.errors import BrokerError
from kstore.records import TopicPartition as TP
from kstore.settings import Settings

from .connect import client_config, open_admin, open_consumer
from .consumer import log_bounds
from .inspector import KafkaInspector

log = logging.getLogger(__name__)

#: The reader's consumer fetches one record per partition: small fetches (the broker still
#: returns the whole first record batch, whatever its size).
_FETCH_CONFIG = {"max_poll_records": 1, "max_partition_fetch_bytes": 16384, "fetch_max_bytes": 65536,
                 "fetch_max_wait_ms": 100}


class LogReader:
    """A group-less consumer (made at the first question) and, for owners, a :class:`KafkaInspector`."""

    def __init__(self, settings: Settings, request_timeout_ms: int) -> None:
        client_config(settings)  # TLS files, a token provider: a mistake is named now, not at the first reading
        self.settings = settings
        self._request_timeout_ms = request_timeout_ms
        self._consumer: Any = None  # partitions, log bounds, timestamps
        self._inspector: KafkaInspector | None = None  # the group's live members (only when asked)

    @contextmanager
    def _kafka_errors(self) -> Iterator[None]:
        try:
            yield
        except KafkaError as exc:
            text = str(exc).strip()
            raise BrokerError(f"Kafka at {self.settings.bootstrap_servers}: "
                              f"{text.splitlines()[0] if text else type(exc).__name__}") from None

    def _kafka_consumer(self) -> Any:
        if self._consumer is None:
            # Assigned partitions, no group. An offset deleted by retention since it was
            # asked for reads from the log start.
            self._consumer = open_consumer(
                self.settings, group_id=None, enable_auto_commit=False, allow_auto_create_topics=False,
                auto_offset_reset="earliest", request_timeout_ms=self._request_timeout_ms, **_FETCH_CONFIG,
            )
        return self._consumer

    def partitions(self, topic: str) -> list[int]:
        """The topic's partitions; none for a topic the cluster does not have (any more)."""
        with self._kafka_errors():
            found = self._kafka_consumer().partitions_for_topic(topic)
        if not found:
            # Offsets stored for a topic deleted since: nothing to measure, and no reason to fail the group.
            log.debug("topic %r has stored offsets but is not in the cluster: left out", topic)
        return sorted(found or ())

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        """``(log start, log end)`` of each partition."""
        with self._kafka_errors():
            return log_bounds(self._kafka_consumer(), tps)

    def live_owners(self, group: str, registered: Collection[str] | None) -> dict[TP, str]:
        """The live member of the Kafka group assigned each partition (see :meth:`KafkaInspector.live_owners`)."""
        with self._kafka_errors():
            if self._inspector is None:
                self._inspector = KafkaInspector(self.settings)
            return self._inspector.live_owners(group, registered)

    def first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        """One record of each partition, from its offset on: its timestamp (None: the record has none).

        A partition whose record did not arrive within ``timeout_s`` is left out (asked again next time).
        """
        with self._kafka_errors():
            consumer = self._kafka_consumer()
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

    def close(self) -> None:
        """Close both clients (after an outage too: nothing to save); the next question opens them again."""
        consumer, inspector = self._consumer, self._inspector
        self._consumer, self._inspector = None, None
        closers: list[Callable[[], None]] = []
        if consumer is not None:
            closers.append(lambda: consumer.close(autocommit=False))
        if inspector is not None:
            closers.append(inspector.close)
        for close in closers:
            try:
                close()
            except Exception:  # closing after an outage: nothing to save
                log.debug("closing a Kafka client failed", exc_info=True)


class PartitionCounts:
    """How many partitions each topic has, for checking what a processor produces before it reaches
    the outbox (:func:`kstore.processor.produce_check`).

    Each answer is trusted for ``topic_recheck_s``, then asked again with a fresh metadata request
    (never one that could create the topic): a missing topic may have been created meanwhile, and a
    topic found may have been deleted. A failed question leaves the last answer (or, for a topic never
    found, "unknown": the record goes on and the relay publishes it when it can).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._admin: Any = None
        #: topic -> (partitions, when to ask again)
        self._known: dict[str, tuple[int, float]] = {}
        self._unreachable_until = 0.0

    def count(self, topic: str) -> int | None:
        """The topic's partitions (0: the cluster has no such topic); None if the brokers did not answer."""
        known = self._known.get(topic)
        now = time.monotonic()
        if known is not None and now < known[1]:
            return known[0]
        if now < self._unreachable_until:
            return None if known is None else known[0]
        try:
            found = self._ask(topic)
        except (BrokerError, KafkaError) as exc:
            log.debug("could not look topic %r up: %s", topic, exc)
            self._unreachable_until = now + self.settings.topic_recheck_s
            self.close()  # a new client next time: this one may be stuck on a broker that left
            return None if known is None else known[0]
        if known is not None and (known[0] > 0) != (found > 0):
            log.info("topic %r %s", topic, "exists again" if found else "no longer exists")
        self._known[topic] = (found, time.monotonic() + self.settings.topic_recheck_s)
        return found

    def _ask(self, topic: str) -> int:
        if self._admin is None:
            self._admin = open_admin(self.settings)
        described = self._admin.describe_topics([topic])
        entry = next((d for d in described if d.get("name") == topic), None)
        if entry is None or entry.get("error_code") == UnknownTopicOrPartitionError.errno:
            return 0
        if entry.get("error_code"):
            raise BrokerError(f"Kafka at {self.settings.bootstrap_servers} could not describe topic "
                              f"{topic!r}: error {entry['error_code']}")
        return len(entry.get("partitions") or ())

    def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                admin.close()
            except Exception:  # closing after an outage: nothing to save
                log.debug("closing a Kafka admin client failed", exc_info=True)
