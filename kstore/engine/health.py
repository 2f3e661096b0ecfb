"""What a running worker says of itself: its probes, its scrape-time gauges, and its outbox backlog.

- :class:`Health`: ``/livez`` (the batch loop and the fetch thread keep turning), ``/readyz``
  (joined, every assigned partition claimed, the database answering, the topics it produces to
  there, the outbox's backlog within bounds), the gauges computed at a scrape (lag per partition,
  buffered records and bytes, fetch paused, outbox backlog), and the HTTP server that serves them
  (``metrics_port``).
- :class:`Backlog`: produced records waiting to be published, as last read and counted up by each
  commit since: what the probes report, and the bound (``outbox_max_pending``) the batch loop
  waits on.

Invariants: nothing here changes a partition's state or writes to the database (the backlog is
read, on the main thread); a scrape or a probe reads the worker's state under
:attr:`Partitions.lock <kstore.engine.partitions.Partitions.lock>` only where it needs one moment
(the queues' heads and the batch taken from them). The probes run on the HTTP server's threads;
the main thread notes its turns (:meth:`Health.turned`), the fetch thread its polls
(:meth:`Health.polled`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from sqlalchemy.exc import SQLAlchemyError

from kstore.settings import Settings
from kstore.telemetry.health import HealthServer, app
from kstore.telemetry.metrics import Metrics, PartitionLag
from kstore.types import TopicPartition as TP
from kstore.types import timestamp_ms

from .backoff import Backoff
from .ownership import Ledger, fmt
from .partitions import Partitions

if TYPE_CHECKING:
    from kstore.relay.loop import Relay
    from kstore.relay.store import Outbox

    from .batches import Batches
    from .claims import Claims

log = logging.getLogger("kstore.engine.worker")

#: How often a worker that has produced reads its outbox's backlog while processing.
BACKLOG_READ_EVERY_S = 1.0


class Backlog:
    """Produced records of this worker's group waiting to be published (see the module's docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: Produced records waiting to be published, as last read (and counted up since), and the
        #: oldest one's time.
        self.waiting = 0
        self.oldest: datetime | None = None
        #: Processing is paused for the backlog (said once when it starts and once when it ends).
        self._paused = False
        #: This worker's batches have produced records (only then is the backlog read and bounded).
        self._has_produced = False
        self._next_read = 0.0

    def produced(self, count: int) -> None:
        """A batch committed ``count`` records to the outbox: they count against outbox_max_pending
        until the next reading of the backlog."""
        self.waiting += count
        self._has_produced = self._has_produced or count > 0

    def full(self, outbox: Outbox | None) -> bool:
        """Backpressure: more produced records wait to be published than ``outbox_max_pending``
        (the relay cannot reach Kafka, say). Read at most once a second once this worker has produced
        anything, and counted up by each commit in between; a failed read leaves the last answer
        (the batch's own commit meets the database's trouble first)."""
        if not self._has_produced:
            return False  # a worker that produces nothing adds nothing to wait for: no query
        now = time.monotonic()
        if now >= self._next_read and outbox is not None:
            self._next_read = now + BACKLOG_READ_EVERY_S
            try:
                self.waiting, self.oldest = outbox.backlog()
            except SQLAlchemyError as exc:
                log.debug("reading the outbox's backlog failed: %s", exc)
        full = self.waiting > self.settings.outbox_max_pending
        if full != self._paused:
            self._paused = full
            log.warning("%d produced records wait to be published (outbox_max_pending=%d): %s",
                        self.waiting, self.settings.outbox_max_pending,
                        "processing paused until the relay catches up" if full else "processing again")
        return full

    def oldest_age(self) -> float:
        """Seconds since the oldest produced record not yet published was written (0: none)."""
        oldest = self.oldest
        return 0.0 if oldest is None else max(0.0, (datetime.now(timezone.utc) - oldest).total_seconds())


@dataclass(frozen=True)
class _Parts:
    """What the probes and the gauges read of a connected worker."""

    partitions: Partitions
    ledger: Ledger
    batches: Batches
    claims: Claims
    group_stable: Callable[[], bool]
    relay: Relay | None


class Health:
    """A worker's probes, gauges and their HTTP server (see the module's docstring)."""

    def __init__(self, settings: Settings, metrics: Metrics, db_backoff: Backoff, backlog: Backlog) -> None:
        self.settings = settings
        self.metrics = metrics
        self.db_backoff = db_backoff
        self.backlog = backlog
        #: When the worker started, and the main loop and the fetch thread last turned (for /livez).
        self.started_at = self.last_turn = self.last_poll = 0.0
        self._parts: _Parts | None = None
        self._http: HealthServer | None = None
        metrics.watch(self.lags, self.gauges)

    def connected(self, partitions: Partitions, ledger: Ledger, batches: Batches, claims: Claims,
                  group_stable: Callable[[], bool], relay: Relay | None) -> None:
        """The worker's parts, once it made them (until then it is "not connected")."""
        self._parts = _Parts(partitions, ledger, batches, claims, group_stable, relay)

    def turned(self) -> None:
        self.last_turn = time.monotonic()

    def polled(self) -> None:
        self.last_poll = time.monotonic()

    # -- the HTTP server ----------------------------------------------------------------

    def serve(self) -> None:
        """Serve /metrics, /livez and /readyz on ``metrics_port`` (if set; once)."""
        self.started_at = time.monotonic()
        port = self.settings.metrics_port
        if port is not None and self._http is None:
            self._http = HealthServer(self.settings.metrics_host, port,
                                      app(self.metrics.registry, self.liveness, self.readiness)).start()
            log.info("serving /metrics, /livez and /readyz on http://%s:%d", self.settings.metrics_host,
                     self._http.port)

    @property
    def port(self) -> int | None:
        """The port /metrics, /livez and /readyz are served on, once started (None: not served)."""
        return None if self._http is None else self._http.port

    def stop(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            http.stop()

    # -- the probes ---------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        """Healthy while the batch loop and the fetch thread keep turning (see kstore.telemetry.health)."""
        now, limit = time.monotonic(), self.settings.liveness_timeout_s
        for what, last in (("the batch loop", self.last_turn), ("the fetch thread", self.last_poll)):
            idle = now - max(last, self.started_at)
            if idle > limit:
                return False, f"{what} has not turned for {idle:.0f}s (liveness_timeout_s={limit:g})"
        return True, "the batch loop and the fetch thread are turning"

    def readiness(self) -> tuple[bool, str]:
        """Ready once joined, every assigned partition claimed, the database answering and the topics
        it produces to there; never again once the dead-letter breaker paused the worker."""
        parts = self._parts
        if parts is None:
            return False, "not connected"
        batches, ledger = parts.batches, parts.ledger
        if batches.paused is not None:
            return False, f"paused by the dead-letter breaker: {batches.paused}"
        if self.db_backoff.failing:
            return False, self.db_backoff.away
        for wait in (batches.topic_wait, batches.registry_wait):
            if wait.missing is not None:
                return False, wait.missing
        if self.backlog.waiting > self.settings.outbox_max_pending:
            return False, (f"{self.backlog.waiting} produced records wait to be published "
                           f"(outbox_max_pending={self.settings.outbox_max_pending})")
        if not parts.claims.assigned_once or not parts.group_stable():
            return False, "not a stable member of the Kafka group yet"
        with ledger.lock:
            pending = sorted(ledger.pending)
        if pending:
            return False, f"claiming {fmt(pending)}"
        return True, f"owns {len(ledger.offsets())} partition(s)"

    # -- the gauges computed at a scrape ---------------------------------------------------

    def lags(self) -> list[PartitionLag]:
        """Per owned partition: high watermark minus stored offset, and the age of the oldest
        message not yet committed (in the batch taken, else at the queue's head). No broker call."""
        parts = self._parts
        if parts is None:
            return []
        state, batches = parts.partitions, parts.batches
        offsets = parts.ledger.offsets()
        with state.lock:  # the queues' heads and the batch taken from them, at one moment
            heads, taken = state.heads(), batches.in_flight
        in_flight: dict[TP, int | None] = {}
        for record in taken:
            tp = (record.topic, record.partition)
            if record.offset >= offsets.get(tp, record.offset + 1):  # not committed yet
                in_flight.setdefault(tp, timestamp_ms(record))
        now_ms = time.time() * 1000
        lags = []
        for tp, committed in sorted(offsets.items()):
            highwater, head_ts = heads.get(tp, (None, None))
            if highwater is None:
                continue
            behind = max(0, highwater - committed)
            oldest = in_flight.get(tp, head_ts)
            seconds = 0.0 if behind == 0 else (None if oldest is None else max(0.0, (now_ms - oldest) / 1000))
            lags.append(PartitionLag(tp[0], tp[1], behind, seconds))
        return lags

    def gauges(self) -> dict[str, tuple[str, float]]:
        parts = self._parts
        if parts is None:
            return {}
        records, size, paused = parts.partitions.buffered()
        relay = parts.relay
        return {
            "kstore_partitions_owned": ("Partitions this worker has claimed and delivers.",
                                        len(parts.ledger.offsets())),
            "kstore_buffered_records": ("Records fetched and waiting in kstore's queues.", records),
            "kstore_buffered_bytes": ("Approximate memory of the records waiting in kstore's queues.", size),
            "kstore_fetch_paused": ("1 while fetching is paused because the queues are full.", float(paused)),
            "kstore_outbox_waiting": ("Produced records committed and not yet published (read once a second "
                                      "while processing).", self.backlog.waiting),
            "kstore_outbox_oldest_seconds": ("Age of the oldest produced record not yet published (0: none).",
                                             self.backlog.oldest_age()),
            "kstore_outbox_shards_blocked": ("Outbox shards this worker's relay holds that are stopped on a record "
                                             "Kafka refused (the rows wait; the log names it).",
                                             len(relay.shards_blocked) if relay is not None else 0),
        }
