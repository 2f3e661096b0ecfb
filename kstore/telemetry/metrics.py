"""What a worker counts and measures, in Prometheus terms (``prometheus_client``).

Every :class:`~kstore.engine.worker.Worker` has its own :class:`Metrics` on its own
registry (so several workers in one process never mix), always recording: it
costs a few counter increments per batch, not per message. ``--metrics-port``
serves it (:mod:`kstore.telemetry.health`); ``kstore exporter`` serves the lag metrics of
groups with no worker running, under the same names.

Names follow Prometheus conventions: base units (seconds, messages, bytes),
``_total`` only on counters, labels ``group``, ``topic``, ``partition``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kstore.types import TopicPartition as TP

log = logging.getLogger(__name__)


class OutboxBacklog(Protocol):
    """One outbox's records waiting, as the gauges read it (the database side's ``Backlog``)."""

    @property
    def name(self) -> str: ...

    @property
    def waiting(self) -> int: ...

    def age_s(self, at: datetime) -> float: ...


#: Every outbox's backlog, by its name (label ``outbox``), wherever it is exported: a relay's /metrics
#: (its own outbox) and ``kstore exporter`` (every outbox in the database).
OUTBOX_WAITING = "kstore_outbox_records_waiting"
OUTBOX_OLDEST_AGE = "kstore_outbox_oldest_record_age_seconds"
#: A relay reads its outbox's backlog at a scrape at most this often (the reading is kept between):
#: Prometheus scrapes every 15 s or so, and several scrapers at once cost the database one statement.
OUTBOX_READ_EVERY_S = 5.0

LAG_MESSAGES = "kstore_lag_messages"
LAG_SECONDS = "kstore_lag_seconds"
LAG_MESSAGES_HELP = "Messages in the log not yet committed: log end minus the stored next offset."
LAG_SECONDS_HELP = "Age of the oldest message not yet committed (0 when caught up)."

#: Why a batch's transaction was rolled back (the ``reason`` label).
ROLLBACK_REASONS = ("error", "fenced", "database", "missing_topic", "schema_registry", "in_doubt", "shutdown")
#: Why kstore placed a partition again because its position left the log (the ``reason`` label;
#: see kstore.engine.positions): moved to start_from, or held for an operator.
POSITION_RESET_REASONS = ("below_log_start", "past_log_end", "truncated")

_SIZE_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class PartitionLag:
    """One partition's lag: messages behind the log end, and the age of the oldest one (None: unknown)."""

    topic: str
    partition: int
    messages: int
    seconds: float | None


def lag_families(group: str, lags: Iterable[PartitionLag]) -> list[GaugeMetricFamily]:
    """The two lag gauges for ``lags`` (shared by the worker and ``kstore exporter``)."""
    messages = GaugeMetricFamily(LAG_MESSAGES, LAG_MESSAGES_HELP, labels=["group", "topic", "partition"])
    seconds = GaugeMetricFamily(LAG_SECONDS, LAG_SECONDS_HELP, labels=["group", "topic", "partition"])
    for lag in lags:
        labels = [group, lag.topic, str(lag.partition)]
        messages.add_metric(labels, lag.messages)
        if lag.seconds is not None:
            seconds.add_metric(labels, lag.seconds)
    return [messages, seconds]


def outbox_families(found: Iterable[OutboxBacklog], at: datetime | None = None) -> list[GaugeMetricFamily]:
    """The two outbox gauges for each outbox of ``found`` (shared by a relay and ``kstore exporter``), the
    oldest's age as of ``at`` (now)."""
    at = at or datetime.now(timezone.utc)
    waiting = GaugeMetricFamily(OUTBOX_WAITING, "Records committed to the outbox and not yet published (marked "
                                "published at most a second after their Kafka commit).", labels=["outbox"])
    oldest = GaugeMetricFamily(OUTBOX_OLDEST_AGE, "Age of the oldest record not yet published, from its write "
                               "(0: none waits).", labels=["outbox"])
    for backlog in found:
        waiting.add_metric([backlog.name], backlog.waiting)
        oldest.add_metric([backlog.name], backlog.age_s(at))
    return [waiting, oldest]


class _OutboxGauges(Collector):
    """The outbox gauges of a relay's own outbox, read at a scrape (at most once an ``every_s``: a
    reading is kept that long). A reading that fails leaves them out of that scrape, never stale."""

    def __init__(self, read: Callable[[], OutboxBacklog], every_s: float) -> None:
        self._read, self.every_s = read, every_s
        self._lock = threading.Lock()
        self._last: tuple[float, OutboxBacklog] | None = None
        self._failing: str | None = None

    def collect(self) -> Iterator[Any]:
        found = self._reading()
        if found is not None:
            yield from outbox_families([found])

    def _reading(self) -> OutboxBacklog | None:
        with self._lock:  # scrapes come on threads of their own: one reading at a time
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self.every_s:
                return self._last[1]
            try:
                found = self._read()
            except Exception as exc:  # the database away: the scrape still answers, without these
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if why != self._failing:  # one line per new problem, not one per scrape
                    log.warning("could not read the outbox's backlog for this scrape: %s", why)
                    self._failing = why
                self._last = None
                return None
            self._failing, self._last = None, (now, found)
            return found


class _Computed(Collector):
    """Gauges computed at scrape time from the worker's state (no broker call)."""

    def __init__(self, group: str, lags: Callable[[], list[PartitionLag]],
                 gauges: Callable[[], Mapping[str, tuple[str, float]]]) -> None:
        self.group, self._lags, self._gauges = group, lags, gauges

    def collect(self) -> Iterator[Any]:
        try:  # a scrape must never fail as a whole: the counters still answer
            lags, gauges = self._lags(), self._gauges()
        except Exception:
            log.warning("could not compute the lag gauges for this scrape", exc_info=True)
            return
        yield from lag_families(self.group, lags)
        for name, (help_text, value) in gauges.items():
            family = GaugeMetricFamily(name, help_text, labels=["group"])
            family.add_metric([self.group], value)
            yield family


class Metrics:
    """A worker's counters, histograms and gauges, on its own registry."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.registry = CollectorRegistry()
        self._outbox_gauges: _OutboxGauges | None = None
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        r, g = self.registry, ["group"]
        self._messages = Counter("kstore_messages_committed", "Messages whose effects and offsets committed.",
                                 ["group", "topic", "partition"], registry=r)
        self._batches = Counter("kstore_batches_committed", "Batches (transactions) committed.", g, registry=r)
        self._rolled_back = Counter("kstore_batches_rolled_back", "Batches rolled back, by reason (database, "
                                    "missing_topic and schema_registry: an outage, waited out).",
                                    ["group", "reason"], registry=r)
        self._batch_size = Histogram("kstore_batch_size_messages", "Messages per committed batch.", g,
                                     buckets=_SIZE_BUCKETS, registry=r)
        self._batch_seconds = Histogram("kstore_batch_duration_seconds",
                                        "From a batch's start to its COMMIT's answer.", g,
                                        buckets=_SECONDS_BUCKETS, registry=r)
        self._commit_seconds = Histogram("kstore_commit_duration_seconds",
                                         "The offsets UPDATE and COMMIT of a batch.", g,
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self._claim_seconds = Histogram("kstore_claim_duration_seconds",
                                        "Claiming newly assigned partitions (one transaction).", g,
                                        buckets=_SECONDS_BUCKETS, registry=r)
        self._rebalances = Counter("kstore_rebalances", "Assignments received from the Kafka group.", g, registry=r)
        self._fenced = Counter("kstore_fenced_commits", "Commits refused because another owner holds a partition.",
                               g, registry=r)
        self._retries = Counter("kstore_retries", "Attempts of a failing message beyond its first.", g, registry=r)
        self._dead_letters = Counter("kstore_dead_letters_written", "Messages dead-lettered.", g, registry=r)
        self._db_errors = Counter("kstore_database_errors", "Database round trips that failed (retried).", g,
                                  registry=r)
        self._outbox_published = Counter("kstore_outbox_published", "Produced records the relay published.", g,
                                         registry=r)
        self._outbox_latency = Histogram("kstore_outbox_publish_latency_seconds",
                                         "From a batch writing records to the outbox to their Kafka commit "
                                         "(the oldest record of each transaction).", g,
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self._relay_fenced = Counter("kstore_outbox_relay_fenced", "Shards this relay lost to another relay's "
                                     "producer.", g, registry=r)
        self._in_doubt = Counter("kstore_in_doubt_resolved", "COMMITs whose answer was lost, read back: outcome "
                                 "landed or not_landed.", ["group", "outcome"], registry=r)
        self._position_resets = Counter(
            "kstore_position_resets", "Positions that left the log (records deleted before they were processed, a "
            "truncation), by reason: below_log_start (moved to start_from), past_log_end or truncated (held).",
            ["group", "reason"], registry=r)
        for reason in ROLLBACK_REASONS:
            self._rolled_back.labels(group, reason)
        for reason in POSITION_RESET_REASONS:
            self._position_resets.labels(group, reason)
        for outcome in ("landed", "not_landed"):
            self._in_doubt.labels(group, outcome)
        # Shown at 0 before the first increment: a rate() over a counter that is not there yet is no rate.
        for counter in (self._batches, self._rebalances, self._fenced, self._retries, self._dead_letters,
                        self._db_errors, self._outbox_published, self._relay_fenced):
            counter.labels(group)

    def watch_outbox(self, read: Callable[[], OutboxBacklog], every_s: float = OUTBOX_READ_EVERY_S) -> None:
        """Register a relay's outbox gauges (:func:`outbox_families`), ``read`` at a scrape at most once
        an ``every_s``; a relay made again on these metrics replaces the last one's (a name twice in a
        scrape is invalid)."""
        if self._outbox_gauges is not None:
            self.registry.unregister(self._outbox_gauges)
        self._outbox_gauges = _OutboxGauges(read, every_s)
        self.registry.register(self._outbox_gauges)

    def watch(self, lags: Callable[[], list[PartitionLag]],
              gauges: Callable[[], Mapping[str, tuple[str, float]]]) -> None:
        """Register the gauges computed at scrape time (lag, buffered records and bytes, fetch paused)."""
        self.registry.register(_Computed(self.group, lags, gauges))

    # -- what the engine reports -------------------------------------------------------------------

    def committed(self, counts: Mapping[TP, int], started: float | None = None,
                  commit_started: float | None = None) -> None:
        """A batch committed: ``counts`` messages per partition; its timings if known (not for
        a commit in doubt found landed)."""
        for (topic, partition), n in counts.items():
            self._messages.labels(self.group, topic, str(partition)).inc(n)
        self._batches.labels(self.group).inc()
        self._batch_size.labels(self.group).observe(sum(counts.values()))
        now = time.monotonic()
        if started is not None:
            self._batch_seconds.labels(self.group).observe(now - started)
        if commit_started is not None:
            self._commit_seconds.labels(self.group).observe(now - commit_started)

    def rolled_back(self, reason: str) -> None:
        self._rolled_back.labels(self.group, reason).inc()

    def claimed(self, seconds: float) -> None:
        self._claim_seconds.labels(self.group).observe(seconds)

    def rebalanced(self) -> None:
        self._rebalances.labels(self.group).inc()

    def fenced(self) -> None:
        self._fenced.labels(self.group).inc()

    def retried(self) -> None:
        self._retries.labels(self.group).inc()

    def dead_lettered(self) -> None:
        self._dead_letters.labels(self.group).inc()

    def database_error(self) -> None:
        self._db_errors.labels(self.group).inc()

    def position_reset(self, reason: str) -> None:
        self._position_resets.labels(self.group, reason).inc()

    def published(self, count: int, oldest: datetime) -> None:
        """The relay published ``count`` outbox records; the first was written at ``oldest``."""
        self._outbox_published.labels(self.group).inc(count)
        self._outbox_latency.labels(self.group).observe(max(0.0, (datetime.now(timezone.utc) - oldest).total_seconds()))

    def relay_fenced(self) -> None:
        self._relay_fenced.labels(self.group).inc()

    def in_doubt_resolved(self, landed: bool) -> None:
        self._in_doubt.labels(self.group, "landed" if landed else "not_landed").inc()
