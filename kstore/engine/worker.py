"""The worker: a fetch thread that polls Kafka, and a main loop that claims
partitions, checks epochs, handles resets and shutdown, and has :mod:`kstore.engine.batches`
process one batch at a time (one transaction with its offsets). What it does between batches for
the group (rebalance events, claims, epoch checks) is :mod:`kstore.engine.claims`'; what it says of
itself (probes, gauges, the outbox's backlog) is :mod:`kstore.engine.health`'.

The worker is a plain object: ``run()``, ``request_stop()``, ``close()``. It
installs no signal handlers; the CLI wires signals to :meth:`request_stop`.

Threads, and who may call what:

- **main thread** (:meth:`Worker.step`): claims, epoch checks, resets, batches,
  every database statement, every processor hook. Nothing else touches the
  database or the processor.
- **fetch thread** (:meth:`Worker.fetch_once`): the client's fetch and the rebalance
  events it brings (:meth:`Claims.apply_events <kstore.engine.claims.Claims.apply_events>`: revoked
  and lost partitions are dropped and flushed at once, assigned ones become pending). It never
  touches the database.
- **the client's callback thread** (kafka-python's IO thread; librdkafka's callbacks run on the
  fetch thread, inside ``consume()``): only pauses and posts events to
  :class:`~kstore.engine.partitions.Partitions`.
- **the deadline watchdog** (:mod:`kstore.db.deadline`): only cuts sockets.
- **the HTTP server's threads** (``metrics_port``): only read, for the probes and the gauges.

Locks: :attr:`Partitions.lock <kstore.engine.partitions.Partitions.lock>` guards every partition's
state (one state per partition, with its queue). It is held across the client's local calls (seek,
pause, resume) and, in ``reset_offsets``, across the store write of the new position (so a partition is
never fetched, delivered and reset at once). It is never held across ``poll()``,
a batch's transaction, a claim or a read of the log bounds: those read state
under the lock, do their I/O without it, and re-check under it before acting.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from sqlalchemy.exc import SQLAlchemyError

from kstore.db.members import GroupMembers
from kstore.db.migration import check_migrated
from kstore.db.sqlerrors import first_line
from kstore.db.store import Store, make_engine
from kstore.errors import BrokerError, ConfigurationError, DatabaseError, KstoreError
from kstore.kafka.clients import SourceFactory, partition_counts, source_class
from kstore.kafka.seam import ConsumerSource, PartitionCounts
from kstore.processor import Processor
from kstore.relay.loop import Relay
from kstore.relay.member import member_name
from kstore.relay.store import Outbox
from kstore.running.concurrency import close_loop
from kstore.running.handler import produce_check
from kstore.running.hooks import call_hook, call_setup, check_processor, dead_letter_topic, declared_topics
from kstore.schemas.formats import bind as bind_formats
from kstore.settings import Settings
from kstore.targets import Target
from kstore.telemetry.metrics import Metrics
from kstore.types import TopicPartition as TP

from .backoff import Backoff
from .batches import Batches
from .claims import Claims
from .health import Backlog, Health
from .onedatabase import OneDatabase
from .ownership import Ledger
from .partitions import Partitions

log = logging.getLogger(__name__)

#: Longest sleep of the main loop when there is nothing to do (it wakes at once for new records).
IDLE_WAIT_S = 0.1
#: First and longest wait before retrying a database that failed (claim or commit).
DB_RETRY_DELAY = 0.5
DB_RETRY_MAX_DELAY = 10.0
#: Python's own collector thresholds, which a worker raises unless someone changed them.
PYTHON_GC_THRESHOLDS = (700, 10, 10)
#: Allocations between two young collections in a worker (Python's default: 700). A worker
#: allocates a few objects per record fetched and delivered, and most of them live on in the
#: queues past the next young collection: at 700, collections (and the full ones they lead to,
#: walking every queued record) cost about a fifth of the worker's CPU per record.
GC_YOUNG_THRESHOLD = 50_000

_T = TypeVar("_T")


def tune_collector() -> None:
    """Raise the young generation's threshold to :data:`GC_YOUNG_THRESHOLD`, unless the
    process set its own thresholds (then they are left as they are)."""
    if gc.get_threshold() == PYTHON_GC_THRESHOLDS:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *PYTHON_GC_THRESHOLDS[1:])
        log.debug("collector thresholds %s (Python's default %s)", gc.get_threshold(), PYTHON_GC_THRESHOLDS)


def _check_output_topics(processor: Processor, settings: Settings, partitions: PartitionCounts) -> None:
    """The topics the processor declares it produces to exist, checked before it starts as its input
    topics are (a topic made later is found: a missing one is looked up again at each attempt)."""
    declared = {topic: f"declared in {type(processor).__name__}.produces"
                for topic in declared_topics(processor) or ()}
    letters_topic = dead_letter_topic(processor, settings)
    if letters_topic is not None:
        declared[letters_topic] = "the dead-letter topic"
    for topic, why in sorted(declared.items()):
        count = partitions.count(topic)
        if count is None:
            raise BrokerError(f"Kafka at {settings.bootstrap_servers} did not say whether output "
                              f"topic {topic!r} exists")
        if count == 0:
            raise ConfigurationError(
                f"output topic {topic!r} does not exist at {settings.bootstrap_servers} ({why}): "
                "create it (kstore topics create PROCESSOR)")


def _at_start(settings: Settings, write: Callable[[], object], doing: str, cannot: str) -> None:
    """A write the start needs, safe to repeat: a database error (a COMMIT whose answer was
    lost, a connection cut) is tried again until ``connect_timeout_s``, then one clear line."""
    deadline = time.monotonic() + settings.connect_timeout_s
    delay = DB_RETRY_DELAY
    while True:
        try:
            write()
            return
        except SQLAlchemyError as exc:
            if time.monotonic() + delay > deadline:
                raise DatabaseError(f"cannot {cannot} in {settings.safe_dsn}: {first_line(exc)}") from None
            log.warning("could not %s (%s); trying again in %.1fs", doing, first_line(exc), delay)
            time.sleep(delay)
            delay = min(delay * 2, DB_RETRY_MAX_DELAY)


class Worker:
    """Runs one :class:`Processor` against Kafka and a database, exactly once."""

    #: Makes the Kafka client; a test (or the simulation) may give its own. None: the one of
    #: ``settings.kafka_client`` (confluent-kafka's or kafka-python's).
    source_factory: SourceFactory | None = None
    #: Makes the partitions' state object (tests and the simulation give it their own lock).
    partitions_factory: Callable[[Settings, ConsumerSource], Partitions] | None = None

    def __init__(self, processor: Processor, settings: Settings | None = None) -> None:
        check_processor(processor)
        self.processor = processor
        self.settings = settings or Settings()
        #: How the processor's keys and values are read and written (a registry, if they need one).
        self._formats = bind_formats(processor, self.settings)
        group = self.settings.group or processor.group
        topics = list(self.settings.topics or processor.topics)
        name = type(processor).__name__
        if not group:
            raise ConfigurationError(f"{name} has no group: set `group = ...` or --group")
        if not topics:
            raise ConfigurationError(f"{name} has no topics: set `topics = [...]` or --topic")
        self.group: str = group
        self.topics = topics
        #: Written into each claimed row: an admin reset keeps it, another worker's claim replaces it.
        #: Also the Kafka client id (unless ``client_id`` is set): `kstore offsets show` names it.
        self.worker_id = member_name()
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._fetch_error: BaseException | None = None
        #: Counters and histograms of this worker, on its own registry (see kstore.telemetry.metrics).
        self.metrics = Metrics(self.group)
        self._db_backoff = Backoff(DB_RETRY_DELAY, DB_RETRY_MAX_DELAY, on_failure=self.metrics.database_error)
        #: Produced records waiting to be published: reported, and bounding processing.
        self._backlog = Backlog(self.settings)
        #: The probes, the gauges computed at a scrape, and their HTTP server.
        self._health = Health(self.settings, self.metrics, self._db_backoff, self._backlog)
        self._set_up = False  # setup() was called: teardown() is, at close()
        self._store: Store | None = None
        self._batches: Batches | None = None
        self._source: ConsumerSource | None = None
        self._ledger: Ledger | None = None
        self._outbox: Outbox | None = None
        #: One pipeline, one database (see kstore.engine.onedatabase); None for a source that cannot
        #: describe its group (a test double).
        self._guard: OneDatabase | None = None
        self._guard_backoff = Backoff(DB_RETRY_DELAY, DB_RETRY_MAX_DELAY)
        self._topic_partitions: PartitionCounts | None = None
        #: Every partition's state: pending, owned, held or fenced, with its queue (connect() makes it).
        self._state: Partitions | None = None
        #: Rebalance events, claims, epoch checks (connect() makes it).
        self._claims: Claims | None = None
        #: Publishes what the processor produced (a thread of its own), unless settings.relay is off.
        self.relay: Relay | None = None

    # -- lifecycle ----------------------------------------------------------

    def connect(self) -> None:
        """Check the database (reachable, migrated), the brokers and the topics; idempotent."""
        if self._source is not None:
            return
        engine = make_engine(self.settings)
        store = Store(engine, self.settings)
        source: ConsumerSource | None = None
        partitions = partition_counts(self.settings)
        try:
            store.check_reachable()
            check_migrated(engine, self.settings)
            if self._formats.uses_registry or self.processor.output_schemas or self.processor.output_key_schemas:
                self._formats.registry().check()
            factory = self.source_factory or source_class(self.settings)
            source = factory(self.settings, self.group, self.topics, self.worker_id)
            source.check_topics()
            _check_output_topics(self.processor, self.settings, partitions)
            if source.describes_group:
                members = GroupMembers(engine, self.group, self.settings.table_prefix, self.settings.schema)
                self._guard = OneDatabase(self.settings, self.group, self.worker_id, members, source,
                                          store.database_id())
        except KstoreError:
            if source is not None:
                source.close()
            partitions.close()
            engine.dispose()
            raise
        self._store, self._source = store, source
        self._state = (self.partitions_factory or Partitions)(self.settings, source)
        self._ledger = Ledger(self.settings, self.group, self.worker_id, store, source, self._state)
        self._outbox = Outbox(engine, self.group, self.settings.table_prefix, self.settings.schema)
        self._ensure_shards(self._outbox)
        self._topic_partitions = partitions
        if self.settings.relay:
            self.relay = Relay(self.settings, self.group, engine, self.metrics, member=self.worker_id)
        self._batches = Batches(self.processor, self.settings, self.group, store, source, self._ledger,
                                self._db_backoff, self._recheck, self.metrics, outbox=self._outbox,
                                check_produced=produce_check(partitions.count,
                                                             self.settings.outbox_max_record_bytes,
                                                             f"Kafka at {self.settings.bootstrap_servers}",
                                                             declared_topics(self.processor)),
                                on_produced=self._produced)
        self._claims = Claims(self.settings, self.processor, self.metrics, self._db_backoff, self._ledger, source,
                              self._batches, self._guard, self._guard_backoff, self.relay)
        self._health.connected(self._state, self._ledger, self._batches, self._claims, source.group_stable,
                               self.relay)

    def _ensure_shards(self, outbox: Outbox) -> None:
        """The group's outbox shards, made if it has none (two workers may make them at once)."""
        _at_start(self.settings, lambda: outbox.ensure_shards(self.settings.outbox_shards),
                  "set up the outbox's shards", f"set up the outbox of group {self.group!r}")

    def run(self, max_batches: int | None = None, idle_timeout: float | None = None) -> None:
        """Process until :meth:`request_stop` (or a bound for tests and scripts is reached).

        ``max_batches``: stop after that many committed batches. ``idle_timeout``:
        stop once partitions are held and no record arrived for that many seconds.
        """
        try:
            self.start()
        except BaseException:
            # What it opened is closed: a librdkafka consumer left to the interpreter's exit, in
            # its group, was seen to hang the process there.
            self.close()
            raise
        # Everything imported and built so far lives as long as the worker: move it out
        # of the collector's reach, so the full collections that millions of
        # short-lived records trigger do not walk it again and again (~10% of CPU).
        gc.freeze()
        tune_collector()
        fetcher = threading.Thread(target=self._fetch_loop, name="kstore-fetch", daemon=True)
        try:
            fetcher.start()
            if self.relay is not None:
                self.relay.start()
            self._loop(max_batches, idle_timeout)
        finally:
            # Stop fetching before leaving the group: poll() and close() must not overlap.
            self._closing.set()
            if fetcher.is_alive():
                fetcher.join(self.settings.poll_timeout_ms / 1000 + 10)
            self.close()

    def start(self) -> None:
        """Connect, call the processor's ``setup()`` and join the group (no thread is started).

        :meth:`run` calls it; a test that drives the worker step by step calls it,
        then :meth:`fetch_once` and :meth:`step` in any order it likes.
        """
        self.connect()
        log.info("worker %s for group %r on %s: database %s, brokers %s", self.worker_id, self.group,
                 ", ".join(self.topics), self.settings.safe_dsn, self.settings.bootstrap_servers)
        # Under the group's lock: workers that start together run their setup() one at a time.
        call_setup(self.processor, self.store.engine, self.group)
        self._set_up = True
        self._register()
        self.source.subscribe(_connected(self._claims).on_rebalance)
        self._health.serve()

    def _register(self) -> None:
        """Before joining the group: this worker's row in its database's registry of the group's workers."""
        if self._guard is not None:
            _at_start(self.settings, self._guard.register, "register this worker with its database",
                      f"register worker {self.worker_id} of group {self.group!r}")

    def _fetch_loop(self) -> None:
        """The fetcher thread: polls Kafka all the time, so the group membership stays alive
        however long a batch runs, and acts on rebalance events (which happen inside poll())."""
        try:
            while not self._closing.is_set():
                self.fetch_once()
        except BaseException as exc:  # handed to the main thread, which raises it
            self._fetch_error = exc
            self.partitions.wake()

    def fetch_once(self) -> None:
        """One turn of the fetcher thread: poll Kafka once, then act on the rebalance events it brought."""
        source, partitions, s = self.source, self.partitions, self.settings
        # Decode at most two batches ahead of processing: the rest waits in
        # kafka-python's buffers, undecoded. Decoding far ahead only costs CPU
        # (and, under one GIL, processing time) for records that wait longer.
        limit = 2 * max(s.max_batch_size, s.max_poll_records)
        room = partitions.room(limit, s.poll_timeout_ms / 1000)
        # Even with no room, poll (for one record): rebalances happen inside poll().
        before = partitions.generations()
        fetched = source.fetch(s.poll_timeout_ms if room else 0, max(room, 1))
        partitions.queue_fetched(before, fetched)
        self._health.polled()
        if s.mirror_offsets:
            source.flush_mirror()
        claims = self._claims
        if claims is not None:  # None until connect() ends: nothing is subscribed yet, no event to apply
            claims.apply_events()

    def step(self) -> bool:
        """One turn of the main loop: tell the processor of revoked partitions, claim new
        ones, check epochs, then process one batch. True if a batch committed."""
        self._health.turned()
        if isinstance(self._fetch_error, ConfigurationError):  # the client's news that asking again cannot help
            raise self._fetch_error
        if self._fetch_error is not None:
            raise BrokerError(f"fetching from Kafka failed: {self._fetch_error}") from self._fetch_error
        if self.relay is not None and self.relay.error is not None:
            raise KstoreError(f"the outbox relay failed ({type(self.relay.error).__name__}: {self.relay.error}): "
                              "nothing would publish what the processor produces, so the worker stops")
        if not _connected(self._claims).turn():
            return False
        if self._backlog.full(self._outbox):
            return False
        return self.batches.process_next()

    def _produced(self, count: int) -> None:
        """A batch committed ``count`` records to the outbox: the relay publishes them at once, and
        they count against outbox_max_pending until the next reading of the backlog."""
        self._backlog.produced(count)
        if self.relay is not None:
            self.relay.wake()

    def _recheck(self, tps: list[TP]) -> None:
        """A batch was fenced on ``tps``: re-read their rows (see Claims.recheck)."""
        _connected(self._claims).recheck(tps)

    def _loop(self, max_batches: int | None, idle_timeout: float | None) -> None:
        partitions, ledger, batches = self.partitions, self.ledger, self.batches
        committed = 0
        last_activity = time.monotonic()
        while not self._stop.is_set():
            if self.step():
                committed += 1
                last_activity = time.monotonic()
                if max_batches is not None and committed >= max_batches:
                    return
                continue
            if ledger.pending or not ledger.owned:
                last_activity = time.monotonic()
            elif idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                return
            ready = batches.ready()
            if partitions.queued() and ready:
                continue
            # Nothing to do now: sleep until records arrive or the group changes (or a retry
            # is due). While a retry waits, sleep even with records queued: never spin; but no
            # longer than until it is due (a processor's backoff may be shorter than IDLE_WAIT_S).
            due = None if ready else batches.due_in()
            partitions.wait(IDLE_WAIT_S if due is None else min(IDLE_WAIT_S, due), unless_queued=ready)

    def request_stop(self) -> None:
        """Finish the batch in flight, commit it, leave the group. Safe from any thread or signal handler."""
        self._stop.set()
        if self._state is not None:
            threading.Thread(target=self._state.wake, daemon=True).start()  # no lock in a signal handler

    def close(self) -> None:
        """Call the processor's teardown, leave the group and close the database pool."""
        source, self._source = self._source, None
        if source is None:
            return
        try:
            if self._set_up:
                call_hook(self.processor, "teardown")
        finally:
            close_loop(self.processor)  # an async processor's event loop, after its teardown
            if self.relay is not None:
                self.relay.close()
            if self._topic_partitions is not None:
                self._topic_partitions.close()
            if self._guard is not None:
                self._guard.forget()
            self._health.stop()
            source.close()
            if self._batches is not None:
                self._batches.close()
            if self._store is not None:
                self._store.engine.dispose()
            log.info("worker for group %r stopped", self.group)

    # -- what the metrics port shows --------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics, /livez and /readyz are served on, once started (None: not served)."""
        return self._health.port

    def liveness(self) -> tuple[bool, str]:
        """Healthy while the batch loop and the fetch thread keep turning (see kstore.telemetry.health)."""
        return self._health.liveness()

    def readiness(self) -> tuple[bool, str]:
        """Ready once joined, every assigned partition claimed, the database answering and the topics
        it produces to there; never again once the dead-letter breaker paused the worker."""
        if self._source is None:
            return False, "not connected"
        return self._health.readiness()

    @property
    def busy(self) -> bool:
        """True while a batch's transaction is open (for the CLI's shutdown timeout)."""
        return self._batches is not None and self._batches.busy

    # The parts connect() builds; each raises a clear error before it was called.

    @property
    def source(self) -> ConsumerSource:
        """The Kafka client: fetches, reports rebalances, seeks, pauses and resumes."""
        return _connected(self._source)

    @property
    def partitions(self) -> Partitions:
        """Every partition's state: owned, held, pending, the queues of fetched records, the lock."""
        return _connected(self._state)

    @property
    def store(self) -> Store:
        """The offsets and history tables of the worker's database."""
        return _connected(self._store)

    @property
    def batches(self) -> Batches:
        """The batch loop: take, transact, commit, failures, commits in doubt."""
        return _connected(self._batches)

    @property
    def ledger(self) -> Ledger:
        """Which partitions the worker owns, holds or must claim, at which epoch and offset."""
        return _connected(self._ledger)

    # -- resets ---------------------------------------------------------------

    def reset_offsets(
        self,
        pairs: Mapping[TP, Target] | Iterable[tuple[TP, Target]],
        *,
        strict: bool | None = None,
        reason: str = "reset_offsets",
    ) -> dict[TP, int]:
        """Move partitions this worker holds to new positions; returns where each went.

        ``pairs``: ``((topic, partition_id), target)`` with a target an int
        offset, a ``datetime``, ``EARLIEST`` or ``LATEST``. Under the partition
        lock, the new position is stored (bumping the epoch, recorded in the
        history), the queued messages are flushed and the consumer seeks, so no
        message fetched before the reset is delivered after it. An invalid
        target logs an error and falls back to ``start_from``; with
        ``strict=True`` (or ``Settings.strict_resets``) it raises
        :class:`InvalidOffsetError` and nothing moves.
        """
        targets = dict(pairs.items() if isinstance(pairs, Mapping) else pairs)
        strict = self.settings.strict_resets if strict is None else strict
        return self.ledger.reset(targets, strict, reason)

    @property
    def held_offsets(self) -> dict[TP, int]:
        """``{(topic, partition_id): next_offset}`` for the partitions this worker delivers now."""
        return {} if self._ledger is None else self._ledger.offsets()

def _connected(part: _T | None) -> _T:
    """A part the worker builds in connect(); a clear error if it was not called."""
    if part is None:
        raise KstoreError("worker is not connected: call run() or connect() first")
    return part
