"""``kstore exporter``: the lag of groups as Prometheus metrics, with or without a worker running.

Each scrape of ``/metrics`` reads every group afresh (:class:`~kstore.ops.lag.LagReader`):

- ``kstore_lag_messages``, ``kstore_lag_seconds`` (the names a worker uses,
  :func:`kstore.telemetry.metrics.lag_families`), ``kstore_stored_offset``, ``kstore_log_start_offset``,
  ``kstore_log_end_offset`` per group, topic, partition;
- ``kstore_dead_letters_waiting`` per group;
- ``kstore_outbox_records_waiting`` and ``kstore_outbox_oldest_record_age_seconds`` per outbox, for every
  outbox in the database (a group's and an application's alike, given as ``--group`` or not; the names a
  relay uses, :func:`kstore.telemetry.metrics.outbox_families`), left out of a scrape whose reading failed;
- ``kstore_exporter_up`` per group: 1 if this scrape read the group, 0 if the database or the brokers
  failed it (its partition metrics are then left out rather than repeated stale), and
  ``kstore_exporter_scrape_errors_total`` per group and ``source`` (``database``, ``kafka``, ``other``).

An outage never stops the exporter: the next scrape connects again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kstore.errors import ConfigurationError, DatabaseError, KstoreError
from kstore.relay.tables import Backlog
from kstore.settings import Settings
from kstore.telemetry.metrics import lag_families, outbox_families

from .lag import GroupReading, LagReader

log = logging.getLogger(__name__)

#: What failed a reading (``other``: an unexpected error, logged with its traceback).
SOURCES = ("database", "kafka", "other")
_PARTITION_LABELS = ["group", "topic", "partition"]


class LagCollector(Collector):
    """Reads the groups at each scrape (one scrape at a time: the reader's clients are not thread-safe)."""

    def __init__(self, reader: LagReader, groups: Sequence[str]) -> None:
        self.reader, self.groups = reader, list(groups)
        self._lock = threading.Lock()
        self._errors = {(group, source): 0 for group in self.groups for source in SOURCES}
        self._failing: dict[str, str] = {}  # group -> the last error logged for it
        self._outboxes_failing: str | None = None  # the last error logged for the outboxes' reading

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            up = GaugeMetricFamily("kstore_exporter_up", "1 if the last scrape read the group from the database "
                                   "and the brokers, 0 if either failed.", labels=["group"])
            seconds = GaugeMetricFamily("kstore_exporter_scrape_duration_seconds", "How long reading the group took.",
                                        labels=["group"])
            families: dict[str, Metric] = {}
            for group in self.groups:
                started = time.monotonic()
                reading = self._read(group)
                seconds.add_metric([group], time.monotonic() - started)
                up.add_metric([group], 0 if reading is None else 1)
                if reading is not None:
                    _merge(families, _group_families(reading))
            outboxes = self._read_outboxes()
            if outboxes is not None:
                _merge(families, outbox_families(outboxes))
            errors = CounterMetricFamily("kstore_exporter_scrape_errors", "Scrapes that could not read the group, "
                                         "by what failed.", labels=["group", "source"])
            for (group, source), count in self._errors.items():
                errors.add_metric([group, source], count)
            yield from families.values()
            yield from (up, errors, seconds)

    def _read(self, group: str) -> GroupReading | None:
        try:
            reading = self.reader.read(group)
        except KstoreError as exc:  # DatabaseError, BrokerError, or a broker refusing the client's configuration
            self._failed(group, "database" if isinstance(exc, DatabaseError) else "kafka", exc)
            return None
        except Exception as exc:  # a bug must not take the exporter down: count it, and start afresh
            log.debug("reading group %r failed", group, exc_info=True)
            self.reader.reset()
            self._failed(group, "other", exc)
            return None
        if self._failing.pop(group, None) is not None:
            log.info("group %r read again", group)
        return reading

    def _read_outboxes(self) -> list[Backlog] | None:
        """Every outbox's backlog, or None (said once per new problem) if the database failed it."""
        try:
            found = self.reader.read_outboxes()
        except Exception as exc:  # DatabaseError, or a bug: the groups' metrics are still served
            if str(exc) != self._outboxes_failing:
                log.warning("cannot read the outboxes: %s", exc, exc_info=not isinstance(exc, KstoreError))
                self._outboxes_failing = str(exc)
            return None
        if self._outboxes_failing is not None:
            log.info("the outboxes read again")
            self._outboxes_failing = None
        return found

    def _failed(self, group: str, source: str, exc: Exception) -> None:
        self._errors[(group, source)] += 1
        if self._failing.get(group) != str(exc):  # one line per new problem, not one per scrape
            log.warning("cannot read group %r (%s): %s", group, source, exc, exc_info=source == "other")
            self._failing[group] = str(exc)


def _merge(families: dict[str, Metric], more: Iterable[Metric]) -> None:
    """One family per name whatever the number of groups: a name twice is invalid exposition."""
    for family in more:
        if family.name in families:
            families[family.name].samples.extend(family.samples)
        else:
            families[family.name] = family


def _group_families(reading: GroupReading) -> Iterator[GaugeMetricFamily]:
    group = reading.group
    yield from lag_families(group, [p.lag for p in reading.partitions])
    stored = GaugeMetricFamily("kstore_stored_offset", "The next offset to process, as stored in kstore_offsets.",
                               labels=_PARTITION_LABELS)
    start = GaugeMetricFamily("kstore_log_start_offset", "The partition's first offset still in the log.",
                              labels=_PARTITION_LABELS)
    end = GaugeMetricFamily("kstore_log_end_offset", "The partition's log end: the offset of its next record.",
                            labels=_PARTITION_LABELS)
    for p in reading.partitions:
        labels = [group, p.topic, str(p.partition)]
        if p.stored_offset is not None:
            stored.add_metric(labels, p.stored_offset)
        start.add_metric(labels, p.log_start)
        end.add_metric(labels, p.log_end)
    dead = GaugeMetricFamily("kstore_dead_letters_waiting", "Dead letters of the group not yet replayed.",
                             labels=["group"])
    dead.add_metric([group], reading.dead_letters)
    yield from (stored, start, end, dead)


class Exporter:
    """Serves the groups' metrics over HTTP until :meth:`request_stop`; installs no signal handlers."""

    def __init__(self, settings: Settings, groups: Sequence[str], port: int, address: str = "0.0.0.0") -> None:
        if not groups:
            raise ConfigurationError("give at least one --group")
        self.port, self.address = port, address
        self.reader = LagReader(settings)
        self.registry = CollectorRegistry()
        self.registry.register(LagCollector(self.reader, groups))
        self.groups = list(groups)
        self._stop = threading.Event()

    def run(self) -> None:
        """Serve ``/metrics`` until :meth:`request_stop`, then close the connections."""
        try:
            try:
                server, thread = start_http_server(self.port, self.address, registry=self.registry)
            except OSError as exc:
                raise ConfigurationError(f"cannot serve on {self.address}:{self.port}: "
                                         f"{exc.strerror or exc}") from None
            host, port = server.server_address[:2]
            log.info("serving metrics of %s on http://%s:%s/metrics", ", ".join(map(repr, self.groups)), host, port)
            # A timed wait, so the signal handler that sets the event is run promptly.
            while not self._stop.wait(0.5):
                pass
            server.shutdown()
            server.server_close()
            thread.join(5)
        finally:
            self.reader.close()

    def request_stop(self) -> None:
        """Stop serving (safe from a signal handler or another thread)."""
        self._stop.set()
