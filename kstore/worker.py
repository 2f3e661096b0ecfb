"""The run loop: claim partitions, take a batch, process it in one transaction
with its offsets, and handle fencing, resets and shutdown.

The worker is a plain object: ``run()``, ``request_stop()``, ``close()``. It
installs no signal handlers; the CLI wires signals to :meth:`request_stop`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import logging
import operator
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from . import deadletters
from .consumer import TP, KafkaSource, Record
from .errors import BrokerError, ConfigurationError, KstoreError, ProcessorError
from .migration import check_migrated
from .ownership import Backoff, Ledger, fmt
from .processor import Message, Processor, run_handler
from .retry import Failure, Failures
from .settings import Settings
from .store import Store, make_engine
from .targets import Target

log = logging.getLogger(__name__)

#: Longest sleep of the main loop when there is nothing to do (it wakes at once for new records).
IDLE_WAIT_S = 0.1
#: First and longest wait before retrying a database that failed (claim or commit).
DB_RETRY_DELAY = 0.5
DB_RETRY_MAX_DELAY = 10.0


@dataclasses.dataclass(frozen=True)
class _Batch:
    records: list[Record]
    #: Queue generation per partition when taken: a partition flushed since keeps its new position.
    generations: dict[TP, int]
    #: Epoch per partition when taken: the commit is fenced if it moved.
    epochs: dict[TP, int]
    #: (next offset, epoch) per partition, for the commit.
    positions: dict[TP, tuple[int, int]]


#: A record's fields in :class:`Message` order, and a Message made from them (a tuple subclass).
_message_fields = operator.attrgetter("topic", "partition", "offset", "key", "value", "headers", "timestamp")
_new_message = functools.partial(tuple.__new__, Message)


class _HandlerFailed(Exception):
    """The processor (or deserializing a message) raised; wraps the original."""


class Worker:
    """Runs one :class:`Processor` against Kafka and a database, exactly once."""

    def __init__(self, processor: Processor, settings: Settings | None = None) -> None:
        self.processor = processor
        self.settings = settings or Settings()
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
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        policy = processor.retry
        if self.settings.max_attempts is not None:
            policy = dataclasses.replace(policy, max_attempts=self.settings.max_attempts)
        self._failures = Failures(policy)
        self.on_error = self.settings.on_error or processor.on_error
        # Raw bytes with the default deserialize(): skip a call per message.
        self._raw = (type(processor).deserialize is Processor.deserialize
                     and processor.key_format == "bytes" and processor.value_format == "bytes")
        self._dead_letters = deadletters.build_table(self.settings.table_prefix, self.settings.schema)
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._fetch_error: BaseException | None = None
        self._revoked_notices: list[list[TP]] = []
        #: True while a batch's transaction is open (for the CLI's shutdown timeout).
        self.busy = False
        self._db_backoff = Backoff(DB_RETRY_DELAY, DB_RETRY_MAX_DELAY)
        self._next_epoch_check = 0.0
        self._store: Store | None = None
        #: The connection batches run on, held from one batch to the next (see _batch_connection).
        self._batch_conn: Connection | None = None
        self._source: KafkaSource | None = None
        self._ledger: Ledger | None = None

    # -- lifecycle ----------------------------------------------------------

    def connect(self) -> None:
        """Check the database (reachable, migrated), the brokers and the topics; idempotent."""
        if self._source is not None:
            return
        engine = make_engine(self.settings)
        store = Store(engine, self.settings)
        source: KafkaSource | None = None
        try:
            store.check_reachable()
            check_migrated(engine, self.settings)
            source = KafkaSource(self.settings, self.group, self.topics, self.worker_id)
            source.check_topics()
        except KstoreError:
            if source is not None:
                source.close()
            engine.dispose()
            raise
        self._store, self._source = store, source
        self._ledger = Ledger(self.settings, self.group, self.worker_id, store, source)

    def run(self, max_batches: int | None = None, idle_timeout: float | None = None) -> None:
        """Process until :meth:`request_stop` (or a bound for tests and scripts is reached).

        ``max_batches``: stop after that many committed batches. ``idle_timeout``:
        stop once partitions are held and no record arrived for that many seconds.
        """
        self.connect()
        log.info("worker %s for group %r on %s: database %s, brokers %s", self.worker_id, self.group,
                 ", ".join(self.topics), self.settings.safe_dsn, self.settings.bootstrap_servers)
        self.processor.engine = self._db.engine
        self.processor.setup()
        # Everything imported and built so far lives as long as the worker: move it out
        # of the collector's reach, so the full collections that millions of
        # short-lived records trigger do not walk it again and again (~10% of CPU).
        gc.freeze()
        fetcher = threading.Thread(target=self._fetch_loop, name="kstore-fetch", daemon=True)
        try:
            self._src.subscribe()
            fetcher.start()
            self._loop(max_batches, idle_timeout)
        finally:
            # Stop fetching before leaving the group: poll() and close() must not overlap.
            self._closing.set()
            if fetcher.is_alive():
                fetcher.join(self.settings.poll_timeout_ms / 1000 + 10)
            self.close()

    def _fetch_loop(self) -> None:
        """The fetcher thread: polls Kafka all the time, so the group membership stays alive
        however long a batch runs, and acts on rebalance events (which happen inside poll())."""
        source = self._src
        s = self.settings
        # Decode at most two batches ahead of processing: the rest waits in
        # kafka-python's buffers, undecoded. Decoding far ahead only costs CPU
        # (and, under one GIL, processing time) for records that wait longer.
        limit = 2 * max(s.max_batch_size, s.max_poll_records)
        try:
            while not self._closing.is_set():
                room = source.room(limit, s.poll_timeout_ms / 1000)
                # Even with no room, poll (for one record): rebalances happen inside poll().
                source.poll(s.poll_timeout_ms if room else 0, max_records=max(room, 1))
                self._apply_events()
        except BaseException as exc:  # handed to the main thread, which raises it
            self._fetch_error = exc
            source.wake()

    def _loop(self, max_batches: int | None, idle_timeout: float | None) -> None:
        source, ledger = self._src, self._led
        batches = 0
        last_activity = time.monotonic()
        while not self._stop.is_set():
            if self._fetch_error is not None:
                raise BrokerError(f"fetching from Kafka failed: {self._fetch_error}") from self._fetch_error
            self._notify_revoked()
            self._claim_pending()
            self._check_epochs()
            if self._process_next():
                batches += 1
                last_activity = time.monotonic()
                if max_batches is not None and batches >= max_batches:
                    return
                continue
            if ledger.pending or not ledger.owned:
                last_activity = time.monotonic()
            elif idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                return
            if source.queued() and self._failures.ready() and self._db_backoff.ready():
                continue
            # Nothing to do now: sleep until records arrive or the group changes (or a retry is due).
            source.wait(IDLE_WAIT_S)

    def request_stop(self) -> None:
        """Finish the batch in flight, commit it, leave the group. Safe from any thread or signal handler."""
        self._stop.set()
        if self._source is not None:
            threading.Thread(target=self._source.wake, daemon=True).start()  # no lock in a signal handler

    def close(self) -> None:
        """Call the processor's teardown, leave the group and close the database pool."""
        source, self._source = self._source, None
        if source is None:
            return
        try:
            self.processor.teardown()
        finally:
            source.close()
            self._drop_batch_connection()
            if self._store is not None:
                self._store.engine.dispose()
            log.info("worker for group %r stopped", self.group)

    @property
    def _src(self) -> KafkaSource:
        if self._source is None:
            raise KstoreError("worker is not connected: call run() or connect() first")
        return self._source

    @property
    def _db(self) -> Store:
        if self._store is None:
            raise KstoreError("worker is not connected: call run() or connect() first")
        return self._store

    @property
    def _led(self) -> Ledger:
        if self._ledger is None:
            raise KstoreError("worker is not connected: call run() or connect() first")
        return self._ledger

    # -- partition ownership --------------------------------------------------

    def _apply_events(self) -> None:
        """On the fetcher thread: act on the rebalance events recorded during ``poll()``, in order.

        Revoked and lost partitions are flushed at once, so no record of theirs
        is delivered after; the processor hears of it on the main thread.
        """
        source, ledger = self._src, self._led
        events = source.take_events()
        if not events:
            return
        with source.lock:
            for kind, tps in events:
                if kind == "assigned":
                    ledger.pending.update(tps)
                    log.info("assigned %s; claiming before any delivery", fmt(tps))
                else:
                    dropped = ledger.drop(tps)
                    if dropped:
                        log.info("%s %s", kind, fmt(dropped))
                        self._revoked_notices.append(dropped)
            source.changed.notify_all()

    def _notify_revoked(self) -> None:
        with self._src.lock:
            notices, self._revoked_notices = self._revoked_notices, []
        for tps in notices:
            self.processor.on_revoked(tps)

    def _revoked(self, tps: list[TP], why: str) -> None:
        if tps:
            log.info("%s %s", why, fmt(tps))
            self.processor.on_revoked(tps)

    def _claim_pending(self) -> None:
        """Claim newly assigned partitions, seek them to their stored offsets, resume them."""
        ledger = self._led
        if not ledger.pending or not self._db_backoff.ready():
            return
        try:
            claimed = ledger.claim_pending()
        except SQLAlchemyError as exc:
            self._db_backoff.failed(f"claim {fmt(ledger.pending)} (they stay paused)", exc)
            return
        self._db_backoff.succeeded()
        if claimed:
            offsets = ledger.offsets()
            log.info("claimed %s", ", ".join(
                f"{t}[{p}]@{offsets.get((t, p), 'held')}" for t, p in claimed))
            self.processor.on_assigned([tp for tp in claimed if tp in offsets])

    def _check_epochs(self) -> None:
        """Every ``epoch_check_interval_s``: notice an operator's reset even on an idle partition."""
        if time.monotonic() < self._next_epoch_check:
            return
        self._next_epoch_check = time.monotonic() + self.settings.epoch_check_interval_s
        orphans = self._led.reclaim_orphans()
        if orphans:
            log.warning("%s still assigned here a session timeout after being fenced: claiming again", fmt(orphans))
        try:
            stale = self._led.stale()
            if stale:
                self._recheck(stale)
        except SQLAlchemyError as exc:
            self._db_backoff.failed("check the partitions' epochs", exc)

    def _recheck(self, tps: list[TP]) -> None:
        _adopted, dropped = self._led.recheck(tps)
        if dropped:
            log.warning("fenced on %s: another worker claimed them; rolled back anything uncommitted", fmt(dropped))
            self._revoked(dropped, "fenced")

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
        return self._led.reset(targets, strict, reason)

    @property
    def held_offsets(self) -> dict[TP, int]:
        """``{(topic, partition_id): next_offset}`` for the partitions this worker delivers now."""
        return {} if self._ledger is None else self._ledger.offsets()

    # -- processing -----------------------------------------------------------

    def _process_next(self) -> bool:
        """Take one batch and process it; True if a batch committed."""
        if not self._failures.ready() or not self._db_backoff.ready():
            return False  # a failed message or the database waits for its next attempt; fetching goes on
        size = self._failures.batch_size(self.settings.max_batch_size)
        if self.settings.batch_linger_ms and 0 < self._src.queued() < size:
            self._src.wait_for(size, self.settings.batch_linger_ms / 1000)
        taken = self._take(size)
        if taken is None:
            return False
        try:
            fenced, msgs = self._transact(taken.records, taken.positions)
        except _HandlerFailed as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, OperationalError):
                self._db_backoff.failed("process a batch", cause)
            elif self._handler_failed(taken.records, cause, taken.epochs):
                return False  # settled: dead-lettered
            self._requeue(taken)
            return False
        except SQLAlchemyError as exc:
            self._requeue(taken)
            self._db_backoff.failed("commit a batch", exc)
            return False
        self._db_backoff.succeeded()
        if fenced:
            self._on_fenced(fenced, taken.epochs)
            self._requeue(taken)
            return False
        self._committed(taken)
        self._notify_committed(msgs)
        return True

    def _take(self, size: int) -> _Batch | None:
        """The next batch, with what it needs to commit (epochs) or to be put back (generations)."""
        source, ledger = self._src, self._led
        with source.lock:
            self._failures.retain(ledger.owned)
            records, ends = source.take_batch(size)
            if not records:
                return None
            generations = {tp: source.generation(tp) or 0 for tp in ends}
            epochs = ledger.epochs(ends)
        positions = {tp: (end, epochs[tp]) for tp, end in ends.items()}
        return _Batch(records, generations, epochs, positions)

    def _requeue(self, taken: _Batch) -> None:
        """Messages of a batch that did not commit go back in front of their queues."""
        self._src.requeue(taken.records, taken.generations)

    def _committed(self, taken: _Batch) -> None:
        self._led.committed(taken.positions)
        if self._failures.active:
            self._failures.done([(r.topic, r.partition, r.offset) for r in taken.records])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("committed %d messages: %s", len(taken.records), ", ".join(
                f"{t}[{p}]->{nxt}@{epoch}" for (t, p), (nxt, epoch) in sorted(taken.positions.items())))

    def _notify_committed(self, msgs: Sequence[Message]) -> None:
        try:
            self.processor.on_committed(msgs)
        except Exception as exc:  # the batch is committed: nothing to retry or roll back
            log.error("%s.on_committed failed (the batch stays committed): %s: %s",
                      type(self.processor).__name__, type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def _handler_failed(self, batch: Sequence[Record], cause: BaseException, epochs: Mapping[TP, int]) -> bool:
        """Decide what a processor failure means; True if the batch is settled (dead-lettered)."""
        failures = self._failures
        if len(batch) > 1:
            log.warning("a batch of %d failed (%s: %s); retrying it in smaller batches to find the bad message",
                        len(batch), type(cause).__name__, cause)
            failures.batch_failed([(r.topic, r.partition, r.offset) for r in batch])
            return False
        record = batch[0]
        failure = failures.message_failed((record.topic, record.partition, record.offset), cause)
        where = f"{record.topic}[{record.partition}] offset {record.offset}"
        if not failures.exhausted(failure):
            log.warning("%s failed (attempt %d of %d): %s; retrying", where, failure.attempts,
                        failures.policy.max_attempts, failure.error)
            return False
        if self.on_error != "dead_letter":
            raise ProcessorError(
                f"processor {type(self.processor).__name__} failed on {where} after {failure.attempts} attempt(s): "
                f"{failure.error}; its offset was not committed (on_error=stop)"
            ) from cause
        return self._dead_letter(record, failure, epochs)

    def _dead_letter(self, record: Record, failure: Failure, epochs: Mapping[TP, int]) -> bool:
        """Write the message to the dead letters in the same transaction that moves its offset past it."""
        tp = (record.topic, record.partition)
        positions = {tp: (record.offset + 1, epochs[tp])}
        try:
            fenced = self._commit_with(
                positions, lambda conn: deadletters.write(conn, self._dead_letters, self.group, record, failure))
        except SQLAlchemyError as exc:
            self._db_backoff.failed("write a dead letter", exc)
            return False
        if fenced:
            self._on_fenced(fenced, epochs)
            return False
        self._led.committed(positions)
        self._failures.done([(record.topic, record.partition, record.offset)])
        log.warning("dead-lettered %s[%d] offset %d after %d attempt(s): %s", record.topic, record.partition,
                    record.offset, failure.attempts, failure.error)
        return True

    def _transact(
        self, batch: Sequence[Record], positions: Mapping[TP, tuple[int, int]]
    ) -> tuple[set[TP], Sequence[Message]]:
        """The batch's transaction: the processor's writes, then its offsets. See :meth:`_commit_with`.

        Returns the fenced partitions and the messages as the processor saw them.
        """
        msgs: Sequence[Message] = ()

        def handle(conn: Connection) -> None:
            nonlocal msgs
            try:
                msgs = self._messages(batch)
                run_handler(self.processor, conn, msgs)
            except Exception as exc:
                raise _HandlerFailed(str(exc)) from exc

        self.busy = True
        try:
            return self._commit_with(positions, handle), msgs
        finally:
            self.busy = False

    def _commit_with(self, positions: Mapping[TP, tuple[int, int]], write: Callable[[Connection], None]) -> set[TP]:
        """One transaction: ``write(conn)``, then ``next_offset`` for each partition ``WHERE epoch = ours``.

        Returns the fenced partitions (the transaction was rolled back) or an empty set (committed).
        """
        store = self._db
        conn = self._batch_connection()
        trans = conn.begin()
        try:
            write(conn)
            # Last statement before COMMIT: the row locks are held as briefly as possible.
            fenced = store.commit_offsets(conn, self.group, positions)
            if fenced:
                trans.rollback()
                return fenced
            trans.commit()
            return set()
        except BaseException:
            # Whatever failed (the processor, the database, a signal), start the next
            # batch on a fresh connection: this one may be broken or mid-transaction.
            self._drop_batch_connection()
            raise

    def _batch_connection(self) -> Connection:
        """The connection batches run on, checked out once and kept.

        Checking a connection out of the pool and back in for every batch costs CPU
        and, worse, a reset (ROLLBACK) that releases the GIL: under a busy fetch
        thread, getting it back can take a whole switch interval (5 ms) per batch.
        """
        if self._batch_conn is None:
            self._batch_conn = self._db.engine.connect()
        return self._batch_conn

    def _drop_batch_connection(self) -> None:
        conn, self._batch_conn = self._batch_conn, None
        if conn is not None:
            try:
                conn.close()  # rolls back anything open and returns it to the pool
            except SQLAlchemyError as exc:
                log.debug("closing the batch connection failed: %s", exc)

    def _messages(self, batch: Sequence[Record]) -> list[Message]:
        """The batch as the processor sees it. Raw bytes: built by C loops, no Python call per message."""
        if self._raw:
            return list(map(_new_message, map(_message_fields, batch)))
        deserialize = self.processor.deserialize
        messages = []
        for r in batch:
            key, value = deserialize(r.key, r.value)
            messages.append(_new_message((r.topic, r.partition, r.offset, key, value, r.headers, r.timestamp)))
        return messages

    def _on_fenced(self, fenced: set[TP], epochs: Mapping[TP, int]) -> None:
        """Some rows no longer carry our epoch; the transaction was rolled back.

        A partition this worker reset itself meanwhile is still ours (the reset
        already flushed and sought it). For the others, the row says whether an
        operator moved it (adopt the new position) or another worker claimed it
        (drop it); the rest of the batch is retried under the same epochs.
        """
        lost = self._led.still_ours(fenced, epochs)
        if lost:
            log.warning("fenced on %s: their epoch moved; rolled back", fmt(lost))
            try:
                self._recheck(lost)
            except SQLAlchemyError:
                self._revoked(self._led.drop(lost, pause=True), "fenced")


def load_processor(path: str) -> Processor:
    """Import ``MODULE:CLASS`` and instantiate it; a clear error if it is not a Processor."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"processor must be MODULE:CLASS, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import processor module {module_name!r}: {exc}") from None
    cls: Any = getattr(module, attr, None)
    if cls is None:
        raise ConfigurationError(f"module {module_name!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise ConfigurationError(f"{path} is not a kstore.Processor subclass")
    instance: Processor = cls()
    return instance
