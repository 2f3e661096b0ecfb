"""One batch at a time: take it, run the processor and commit its offsets in one
transaction, and deal with what goes wrong (fencing, processor failures, retries in
smaller batches, dead letters, the database going away).

:class:`Batches` runs on the worker's main thread; the worker owns the partitions
(claims, epochs, resets) and hands this the callbacks it needs when a commit is fenced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import operator
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from kstore.db import dbapi, deadletters
from kstore.db.outbox import Outbox
from kstore.db.sqlerrors import database_state, first_line, transient
from kstore.db.store import FencedCommit, Row, Store, TransactionEnded
from kstore.db.writes import WRITES
from kstore.errors import (
    BrokerError,
    CommitInDoubtError,
    MissingTopicError,
    ProcessorContractError,
    ProcessorError,
    RegistryUnavailableError,
    TooManyDeadLettersError,
)
from kstore.kafka.seam import ConsumerSource
from kstore.processor import Processor
from kstore.retry import DeserializationError, Failure, Retry
from kstore.running.handler import NOT_THE_MESSAGE, Concurrency, Outgoing, run_handler
from kstore.running.hooks import call_hook, dead_letter_topic, is_async_processor
from kstore.schemas.registry import UnknownSchemaError
from kstore.schemas.unknown import UnknownIds
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics
from kstore.telemetry.tracing import Tracing
from kstore.types import Message, Position, Produced, Record, timestamp_ms
from kstore.types import TopicPartition as TP

from .backoff import Backoff
from .failures import Breaker, Failures, MessageKey
from .ownership import Ledger, fmt
from .waits import OutageWait

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Batch:
    records: list[Record]
    #: Queue generation per partition when taken: a partition flushed since keeps its new position.
    generations: dict[TP, int]
    #: Per partition: (stored offset, offset after the batch, epoch) when taken. The commit
    #: matches the first and the last (compare-and-set), so it is fenced if either moved.
    positions: dict[TP, Position]
    #: Records per partition, when known as taken (else counted from ``records``).
    taken_counts: dict[TP, int] | None = None

    def counts(self) -> Mapping[TP, int]:
        """Records per partition (for the metrics)."""
        return _counts(self.records) if self.taken_counts is None else self.taken_counts


@dataclasses.dataclass(frozen=True)
class _InDoubt:
    """A transaction whose COMMIT raised: it may have landed or not, and is settled by reading back."""

    taken: _Batch
    #: The messages as the processor saw them (for on_committed), empty for a dead letter.
    msgs: Sequence[Message]
    #: The COMMIT's own error (the reason to retry, should it not have landed).
    cause: Exception
    what: str
    #: The messages it dead-lettered, with their failures (for the dead-letter breaker).
    letters: Sequence[tuple[Record, Failure]] = ()


class _Decoded(NamedTuple):
    """A batch as the processor sees it: its messages (deserialized) and, in the same order, their
    records; and the records whose key or value could not be deserialized, with the error."""

    msgs: list[Message]
    records: Sequence[Record]
    undecodable: list[tuple[Record, Exception]]


class _CommitInDoubt(Exception):
    """The COMMIT itself raised: the server may or may not have committed."""

    #: The batch's messages as the processor saw them, set by :meth:`Batches._transact`.
    msgs: Sequence[Message] = ()
    #: The messages it dead-lettered, set by :meth:`Batches._transact`.
    letters: Sequence[tuple[Record, Failure]] = ()


#: A kafka-python record's fields in :class:`Message` order, and a Message made from them (a tuple subclass).
_message_fields = operator.attrgetter("topic", "partition", "offset", "key", "value", "headers", "timestamp")
_new_message = functools.partial(tuple.__new__, Message)
_tp_of = operator.attrgetter("topic", "partition")
_topic_of = operator.itemgetter(0)  # a Message's topic


def _counts(records: Sequence[Record]) -> Counter[TP]:
    """Messages per partition (C loops: this runs once per batch over every record)."""
    return Counter(map(_tp_of, records))


class _HandlerFailed(Exception):
    """The processor (or deserializing a message) raised; wraps the original."""


class Batches:
    """Takes, processes and commits batches for one worker, and handles their failures."""

    def __init__(
        self,
        processor: Processor,
        settings: Settings,
        group: str,
        store: Store,
        source: ConsumerSource,
        ledger: Ledger,
        db_backoff: Backoff,
        recheck: Callable[[list[TP]], None],
        metrics: Metrics | None = None,
        outbox: Outbox | None = None,
        check_produced: Callable[[Produced], None] | None = None,
        on_produced: Callable[[int], None] | None = None,
    ) -> None:
        self.processor = processor
        #: Where the records a batch produces are written (in its transaction); without it, produce() fails.
        self.outbox = outbox
        self._check_produced = check_produced
        #: Called with their number after a batch that produced records committed (the relay publishes
        #: at once; the worker counts them against outbox_max_pending).
        self._on_produced = on_produced
        #: How many records the batch in flight wrote to the outbox.
        self._produced_now = 0
        self.metrics = metrics or Metrics(group)
        #: Spans per batch and per message, if OpenTelemetry is installed and configured.
        self.tracing = Tracing(group)
        self.settings = settings
        self.group = group
        self.store, self.source, self.ledger = store, source, ledger
        self.partitions = ledger.partitions
        #: Shared with the worker's claims and checks: one database, one backoff.
        self.db_backoff = db_backoff
        #: A topic the processor produces to is missing: batches wait for it, as for the database.
        self.topic_wait = OutageWait(self.metrics, "missing_topic", "the output topic is back")
        #: The schema registry does not answer (reading a record's schema, or producing with one): the same.
        self.registry_wait = OutageWait(self.metrics, "schema_registry", "the schema registry answers again")
        #: Whether a record's unknown schema id is its own fault or the registry's (then waited out as above).
        self.unknown_ids = UnknownIds()
        self._recheck = recheck
        policy = processor.retry
        if settings.max_attempts is not None:
            policy = dataclasses.replace(policy, max_attempts=settings.max_attempts)
        self.failures = Failures(policy, settings.log_statement_parameters)
        self.on_error = settings.on_error or processor.on_error
        #: Messages dead-lettered in a row; past its limits the worker stops, or pauses (see _count_letters).
        self.breaker = Breaker(settings.max_consecutive_dead_letters, settings.max_consecutive_rejects)
        #: Why the dead-letter breaker paused the worker (dead_letter_breaker=pause): no batch is taken.
        self.paused: str | None = None
        #: An async processor's batches: how many at once, in what order, and bounded by the liveness
        #: timeout (a handler that never returns fails its batch, which is then narrowed down).
        self._concurrency = (Concurrency.of(processor, settings.max_concurrency, settings.ordering,
                                            settings.liveness_timeout_s)
                             if is_async_processor(processor) else None)
        # Raw bytes with the default deserialize(): skip a call per message.
        self._raw = (type(processor).deserialize is Processor.deserialize
                     and processor.key_format == "bytes" and processor.value_format == "bytes")
        self._dead_letters = deadletters.build_table(settings.table_prefix, settings.schema)
        #: Where each new dead letter is also produced, through the outbox in its transaction (None: nowhere).
        self.dead_letter_topic = dead_letter_topic(processor, settings)
        if self.dead_letter_topic is not None and outbox is None:
            raise ProcessorContractError("dead_letter_topic needs the outbox: this runner has none")
        #: True while a batch's transaction is open (for the CLI's shutdown timeout).
        self.busy = False
        #: The last batch taken was at least half of the batch size: a backlog, where batches linger.
        self._draining = False
        #: The connection batches run on, held from one batch to the next (see _batch_connection).
        self._batch_conn: Connection | None = None
        #: A commit whose outcome is unknown: nothing else is processed until it is settled.
        self.in_doubt: _InDoubt | None = None
        #: The records of the last batch taken (read by the metrics' lag, from another thread, under the
        #: partitions' lock); once committed they lie below the stored offsets and the lag ignores them.
        self.in_flight: Sequence[Record] = ()
        #: When the batch in flight sent its offsets UPDATE (the commit's duration starts there).
        self._commit_started = 0.0
        #: The first message of the batch that last failed with a database error, and whether the
        #: database has answered since (a probe before the batch's next attempt): see :meth:`_failed`.
        self._db_failed: tuple[MessageKey, bool] | None = None

    def ready(self) -> bool:
        """False while a failed message or the database waits for its next attempt, or the breaker paused."""
        return (self.paused is None and self.failures.ready() and self.db_backoff.ready()
                and self.topic_wait.ready() and self.registry_wait.ready())

    def due_in(self) -> float | None:
        """Seconds until :meth:`ready` turns true by itself (0 if it is), or None while the breaker
        paused the worker (nothing ends that wait but a restart)."""
        if self.paused is not None:
            return None
        due = max(self.failures.not_before, self.db_backoff.not_before, self.topic_wait.not_before,
                  self.registry_wait.not_before)
        return max(0.0, due - time.monotonic())

    def close(self) -> None:
        self._drop_batch_connection()

    def process_next(self) -> bool:
        """Settle a commit in doubt, or take one batch and process it; True if a batch committed."""
        if self.in_doubt is not None:
            return self._resolve()
        if not self.ready():
            return False  # a failed message or the database waits for its next attempt; fetching goes on
        size = self.failures.batch_size(self.settings.max_batch_size)
        # Linger only while draining a backlog (the last batch was at least half full): there it
        # keeps transactions large; a steady stream's small batches go at once, never delayed.
        if self._draining and self.settings.batch_linger_ms and 0 < self.partitions.queued() < size:
            self.partitions.wait_for(size, self.settings.batch_linger_ms / 1000)
        taken = self._take(size)
        if taken is None:
            return False
        if not self._probe(taken):
            self._requeue(taken)
            return False
        self._draining = 2 * len(taken.records) >= size
        started = time.monotonic()
        try:
            taken, decoded = self._decode(taken)
            fenced, msgs, letters = self._transact(taken, decoded)
        except _CommitInDoubt as exc:
            self.in_doubt = _InDoubt(taken, exc.msgs, _cause(exc), "a batch", exc.letters)
            return self._resolve()
        except (_HandlerFailed, SQLAlchemyError, MissingTopicError, RegistryUnavailableError) as exc:
            if not self._failed(taken, _cause(exc), "process a batch"):
                self._requeue(taken)
            return False
        self.db_backoff.succeeded()
        self.topic_wait.succeeded()
        self.registry_wait.succeeded()
        if fenced:
            self.metrics.rolled_back("fenced")
            self._on_fenced(fenced, taken.positions)
            self._requeue(taken)
            return False
        self._committed(taken)
        self.metrics.committed(taken.counts(), started, self._commit_started)
        self._notify_committed(msgs)
        self._count_letters(taken.records, letters)
        return True

    def _take(self, size: int) -> _Batch | None:
        """The next batch, with what it needs to commit (positions) or to be put back (generations)."""
        partitions, ledger = self.partitions, self.ledger
        with partitions.lock:
            self.failures.retain(ledger.owned)
            records, ends, counts = partitions.take_batch(size, self.failures.focus(partitions.has_records))
            if not records:
                return None
            # Under the lock that took them from the queues: a scrape sees them in one place or the other.
            self.in_flight = records
            generations = {tp: partitions.generation(tp) or 0 for tp in ends}
            positions = ledger.positions(ends)
        return _Batch(records, generations, positions, counts)

    def _requeue(self, taken: _Batch) -> None:
        """Messages of a batch that did not commit go back in front of their queues."""
        self.partitions.requeue(taken.records, taken.generations)

    def _committed(self, taken: _Batch) -> None:
        self._db_failed = None
        if self._produced_now:
            self.produced(self._produced_now)
            self._produced_now = 0
        self.ledger.committed(taken.positions)
        if self.settings.mirror_offsets:
            self.source.mirror({tp: new for tp, (_, new, _) in taken.positions.items()})
        if self.failures.active:
            self.failures.done([(r.topic, r.partition, r.offset) for r in taken.records])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("committed %d messages: %s", len(taken.records), ", ".join(
                f"{t}[{p}]->{nxt}@{epoch}" for (t, p), (_, nxt, epoch) in sorted(taken.positions.items())))

    def produced(self, count: int) -> None:
        """``count`` records may have been committed to the outbox: wake the relay."""
        if self._on_produced is not None:
            self._on_produced(count)

    def _notify_committed(self, msgs: Sequence[Message]) -> None:
        if not msgs:
            return
        try:
            call_hook(self.processor, "on_committed", msgs)
        except ProcessorContractError:
            raise
        except Exception as exc:  # the batch is committed: nothing to retry or roll back
            log.error("%s.on_committed failed (the batch stays committed): %s: %s",
                      type(self.processor).__name__, type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    # -- commits in doubt -------------------------------------------------------

    def _resolve(self) -> bool:
        """Settle the commit in doubt by reading its rows back on a fresh connection; True if it landed.

        Landed (the rows hold the batch's end under our epoch): the batch is committed,
        whatever the error said. Not landed (the rows still hold its start): it is
        put back and retried. Rows whose epoch moved meanwhile are another owner's or an
        operator's now: handled as fenced, their records dropped. If the database cannot
        be read, nothing else happens until it can: the worker never guesses.
        """
        doubt = self.in_doubt
        assert doubt is not None
        if not self.db_backoff.ready():
            return False
        positions = doubt.taken.positions
        try:
            # Waiting for the rows' locks: the COMMIT may still be running on the server (cut by the
            # deadline, say), and a plain read would not see it yet and call it "did not land".
            rows = self.store.rows(self.group, partitions=list(positions), wait_for_locks=True)
        except SQLAlchemyError as exc:
            self.db_backoff.failed(f"learn whether the commit of {doubt.what} landed (its answer was lost)", exc)
            return False
        self.in_doubt = None
        self.db_backoff.succeeded()
        landed, moved = _outcome(positions, rows)
        if moved:
            self._on_fenced(moved, positions)
        self.metrics.in_doubt_resolved(landed)
        if landed:
            log.warning("the COMMIT of %s (%s) lost its answer (%s) but landed: not processing it again",
                        doubt.what, _describe(positions), first_line(doubt.cause))
            self._committed(doubt.taken)
            self.produced(0)  # it may have produced records: a wake-up that finds none costs one query
            if doubt.msgs:
                self.metrics.committed(doubt.taken.counts())
            else:
                self.metrics.dead_lettered()
            self._notify_committed(doubt.msgs)
            self._count_letters(doubt.taken.records, doubt.letters)
            return True
        self.metrics.rolled_back("in_doubt")
        log.warning("the COMMIT of %s (%s) lost its answer (%s) and did not land: processing it again",
                    doubt.what, _describe(positions), first_line(doubt.cause))
        if not self._failed(doubt.taken, doubt.cause, f"commit {doubt.what}"):
            self._requeue(doubt.taken)
        return False

    # -- failures ---------------------------------------------------------------

    def _failed(self, taken: _Batch, cause: BaseException, what: str) -> bool:
        """A batch did not commit. The database being away, or a topic it produces to, is retried as
        it is, after a backoff; anything else is the batch's failure (see :meth:`_handler_failed`).
        True if the batch is settled (dead-lettered, or in doubt): do not requeue it.

        No batch is retried at the same size forever: one that fails with a database error
        again after the database answered in between (the probe before its retry, see
        :meth:`_probe`) is not meeting an outage but causing its error (a statement longer
        than the deadline, a session the server ends for idling inside it): that is the
        batch's failure, narrowed down to a message and counted against it by policy.
        """
        if isinstance(cause, MissingTopicError):  # an outage too, never a message's fault: waited out
            self.topic_wait.failed(cause)
            return False
        if isinstance(cause, RegistryUnavailableError):  # the same
            self.registry_wait.failed(cause)
            return False
        if transient(cause):
            key = _first(taken)
            if self._db_failed == (key, True) and not database_state(cause):
                self._db_failed = None
                log.warning("%s failed again (%s) though the database answered in between: not an outage; "
                            "taken as a failure of the batch's messages", what, first_line(cause))
                self.db_backoff.succeeded()
                self.metrics.rolled_back("error")
                return self._handler_failed(taken, cause)
            self._db_failed = (key, False)
            self.metrics.rolled_back("database")
            self.db_backoff.failed(what, cause)
            return False
        self.metrics.rolled_back("error")
        return self._handler_failed(taken, cause)

    def _probe(self, taken: _Batch) -> bool:
        """Before the retry of a batch that failed with a database error: does the database answer
        now (``SELECT 1`` on a fresh connection)? False (a backoff is set) if it does not: an outage.
        Nothing is asked for any other batch."""
        if self._db_failed is None:
            return True
        key, answered = self._db_failed
        if key != _first(taken):
            self._db_failed = None
            return True
        if answered:
            return True
        try:
            conn = self._batch_connection()
            conn.exec_driver_sql("SELECT 1")
            conn.rollback()
        except SQLAlchemyError as exc:
            self._drop_batch_connection()
            self.db_backoff.failed("reach the database", exc)
            return False
        self._db_failed = (key, True)
        return True

    def _handler_failed(self, taken: _Batch, cause: BaseException) -> bool:
        """Decide what a processor failure means; True if the batch is settled (dead-lettered or in doubt)."""
        failures, batch = self.failures, taken.records
        if len(batch) > 1:
            # One line when a failure is first met; the narrowing down that follows is DEBUG.
            already = any(failures.isolating((r.topic, r.partition)) for r in batch[:1])
            (log.debug if already else log.warning)(
                "a batch of %d failed (%s); retrying it in smaller batches to find the bad message",
                len(batch), failures.describe(cause))
            failures.batch_failed([(r.topic, r.partition, r.offset) for r in batch])
            return False
        record = batch[0]
        failure = failures.message_failed((record.topic, record.partition, record.offset), cause)
        where = f"{record.topic}[{record.partition}] offset {record.offset}"
        if not failures.exhausted(failure):
            self.metrics.retried()
            log.warning("%s failed (attempt %d of %d): %s; retrying", where, failure.attempts,
                        failures.policy.max_attempts, failure.logged, extra=_fields(record))
            return False
        if self.on_error != "dead_letter":
            raise ProcessorError(
                f"processor {type(self.processor).__name__} failed on {where} after {failure.attempts} attempt(s): "
                f"{failure.logged}; its offset was not committed (on_error=stop)"
            ) from cause
        return self._dead_letter(taken, failure)

    def _dead_letter(self, taken: _Batch, failure: Failure) -> bool:
        """Write the message to the dead letters in the same transaction that moves its offset past it."""
        record = taken.records[0]
        try:
            fenced = self._commit_with(taken.positions, lambda conn: self._write_letter(conn, record, failure))
        except _CommitInDoubt as exc:
            self.in_doubt = _InDoubt(taken, (), _cause(exc), "a dead letter", [(record, failure)])
            return True
        except SQLAlchemyError as exc:
            self.metrics.rolled_back("database")
            self.db_backoff.failed("write a dead letter", exc)
            return False
        if fenced:
            self.metrics.rolled_back("fenced")
            self._on_fenced(fenced, taken.positions)
            return False
        self._committed(taken)
        self.metrics.dead_lettered()
        log.warning("dead-lettered %s[%d] offset %d after %d attempt(s): %s", record.topic, record.partition,
                    record.offset, failure.attempts, failure.logged, extra=_fields(record))
        self._count_letters(taken.records, [(record, failure)])
        return True

    def _write_letter(self, conn: Connection, record: Record, failure: Failure) -> None:
        """A dead letter alone in its transaction, and its topic's record (if any) in the outbox."""
        produced = self._letter(conn, record, failure)
        if produced is not None:
            assert self.outbox is not None
            self.outbox.write(conn, [produced])
            self._produced_now = 1

    def _letter(self, conn: Connection, record: Record, failure: Failure) -> Produced | None:
        """Write a dead letter in ``conn``'s transaction; its dead-letter topic's record, to produce in that
        transaction, if there is a topic and the letter is new (a letter already waiting for the message
        took the new failure: its record was produced then)."""
        if deadletters.write(conn, self._dead_letters, self.group, record, failure) and self.dead_letter_topic:
            return deadletters.topic_record(self.dead_letter_topic, self.group, record, failure)
        return None

    def _count_letters(self, records: Sequence[Record], letters: Sequence[tuple[Record, Failure]]) -> None:
        """A batch of ``records`` committed with ``letters`` dead-lettered: past the breaker's limits
        (see :class:`~kstore.engine.failures.Breaker`), stop the worker or pause it, by policy."""
        why = self.breaker.committed(records, letters)
        if why is None:
            return
        if self.settings.dead_letter_breaker == "pause":
            self.paused = why
            log.error("dead-letter breaker: %s; paused: no more batches until the worker is restarted "
                      "(dead_letter_breaker=pause)", why)
            return
        raise TooManyDeadLettersError(
            f"{why}; the worker stops (dead_letter_breaker=stop): a processor that fails on every message is more "
            f"likely broken than every message bad. See `kstore dead-letters list --group {self.group}`, fix the "
            "cause, then replay them")

    # -- the transaction ----------------------------------------------------------

    def _transact(self, taken: _Batch, decoded: _Decoded,
                  ) -> tuple[set[TP], Sequence[Message], Sequence[tuple[Record, Failure]]]:
        """The batch's transaction: the processor's writes, then its offsets. See :meth:`_commit_with`.

        Returns the fenced partitions, the messages as the processor saw them and those dead-lettered
        with their failures (all three only if it committed). Messages that
        could not be deserialized (``decoded.undecodable``, only with on_error=dead_letter) never
        reach the processor: they are dead-lettered in this same transaction.
        """
        msgs: Sequence[Message] = decoded.msgs
        rejects: list[tuple[int, Exception]] | None = [] if self.on_error == "dead_letter" else None
        letters: list[tuple[Record, Failure]] = []
        outgoing = Outgoing(self._check_produced) if self.outbox is not None else None

        def handle(conn: Connection) -> None:
            nonlocal msgs
            self._handle(conn, msgs, rejects, outgoing)
            if rejects or decoded.undecodable:
                msgs = self._dead_letter_rejects(conn, decoded, rejects or [], letters, outgoing)
            self._write_outgoing(conn, outgoing)

        self.busy = True
        try:
            try:
                fenced = self._commit_with(taken.positions, handle)
                if not fenced:
                    for record, failure in letters:
                        self.metrics.dead_lettered()
                        log.warning("dead-lettered %s[%d] offset %d at once: %s", record.topic, record.partition,
                                    record.offset, failure.logged, extra=_fields(record))
                return fenced, msgs, letters
            except _CommitInDoubt as exc:
                exc.msgs, exc.letters = msgs, letters
                raise
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a stop signal's timeout, or a second signal: rolled back
                    self.metrics.rolled_back("shutdown")
                raise
        finally:
            self.busy = False

    def _handle(self, conn: Connection, msgs: Sequence[Message], rejects: list[tuple[int, Exception]] | None,
                outgoing: Outgoing | None) -> None:
        """The processor on the batch's messages (none: not called), inside the batch's transaction."""
        if not msgs:
            return  # every message of the batch was set aside (it could not be deserialized)
        try:
            run_handler(self.processor, conn, msgs, self.tracing, rejects, outgoing, self._concurrency)
        except NOT_THE_MESSAGE:
            raise  # a contract broken stops the worker, a missing topic waits: no message is to blame
        except Exception as exc:
            raise _HandlerFailed(str(exc)) from exc

    def _write_outgoing(self, conn: Connection, outgoing: Outgoing | None) -> None:
        """The records the batch produced, into the outbox: last before the offsets, so the shards'
        row locks are held from here to COMMIT."""
        self._produced_now = len(outgoing.records) if outgoing is not None else 0
        if outgoing is not None and outgoing.records:
            assert self.outbox is not None
            self.outbox.write(conn, outgoing.records)

    def _dead_letter_rejects(self, conn: Connection, decoded: _Decoded, rejects: list[tuple[int, Exception]],
                             letters: list[tuple[Record, Failure]], outgoing: Outgoing | None) -> list[Message]:
        """Final errors raised before the message did anything, and messages that could not be
        deserialized: dead-lettered in this same transaction, which commits the rest of the batch
        and moves past them (in offset order). Returns the messages that were handled."""
        found = [(decoded.records[index], error) for index, error in rejects] + decoded.undecodable
        for record, error in sorted(found, key=lambda item: (item[0].topic, item[0].partition, item[0].offset)):
            failure = Failure(final=True)
            failure.record(error)
            letters.append((record, failure))
            produced = self._letter(conn, record, failure)
            if produced is not None and outgoing is not None:
                outgoing.records.append(produced)  # with the batch's own records, written last before the offsets
        rejected = {index for index, _ in rejects}
        return [m for i, m in enumerate(decoded.msgs) if i not in rejected]

    def _commit_with(self, positions: Mapping[TP, Position], write: Callable[[Connection], None]) -> set[TP]:
        """One transaction: ``write(conn)``, then the compare-and-set of each partition's offset.

        Returns the fenced partitions (the transaction was rolled back) or an empty set
        (committed). Raises what ``write`` or the database raised before COMMIT (nothing
        landed), or :class:`_CommitInDoubt` if the COMMIT itself raised (it may have).
        """
        one_trip = self.store.one_round_trip_commit
        conn = self._batch_connection()
        try:
            trans = conn.begin()
            self._write(conn, trans, write, one_trip)
            fenced = self._before_commit(conn, trans, positions, one_trip)
            if fenced:
                return fenced
        except TransactionEnded as exc:
            self._drop_batch_connection()
            raise _ended(exc) from exc
        except BaseException:
            # Whatever failed (the processor, the database, a signal), start the next
            # batch on a fresh connection: this one may be broken or mid-transaction.
            self._drop_batch_connection()
            raise
        try:
            if one_trip:
                # The compare-and-set and COMMIT in one round trip (kstore.db.store): a fenced one
                # raises in the server before its COMMIT; any other error may have come after it.
                # (If nothing of the batch touched the database, its BEGIN rides in this message too.)
                self.store.commit_in_one_round_trip(conn, self.group, positions)
            trans.commit()  # sends COMMIT, except after the one-trip commit (psycopg2 in autocommit mode)
        except FencedCommit:
            self._drop_batch_connection()
            return self._fenced_now(positions)
        except TransactionEnded as exc:
            self._drop_batch_connection()
            raise _ended(exc) from exc
        except Exception as exc:
            # The COMMIT was sent, or may have been: the server may have committed and
            # its answer been lost. Never assume either way (see _resolve).
            self._drop_batch_connection()
            raise _CommitInDoubt(str(exc)) from exc
        except BaseException:
            self._drop_batch_connection()
            raise
        return set()

    def _before_commit(self, conn: Connection, trans: Any, positions: Mapping[TP, Position], one_trip: bool) -> set[TP]:
        """After the batch's writes: the partitions it must not commit (the transaction is rolled
        back), or none. Without the one-trip commit, the offsets' compare-and-set goes here."""
        gone = self.ledger.dropped(positions)
        if gone:
            # Revoked or lost while the batch ran (an incremental rebalance takes some partitions and
            # leaves the rest): nothing of the batch commits; the rest of it is retried. A revoke
            # after this check is met by the epoch (the new owner's claim fences the commit).
            self._drop_batch_connection()
            return gone
        self._commit_started = time.monotonic()
        if one_trip:
            return set()
        self.store.check_own_transaction(conn)
        # Last statement before COMMIT: the row locks are held as briefly as possible.
        fenced = self.store.commit_offsets(conn, self.group, positions)
        if fenced:
            trans.rollback()
        return fenced

    @staticmethod
    def _write(conn: Connection, trans: Any, write: Callable[[Connection], None], one_trip: bool) -> None:
        """The batch's own writes, inside its transaction ``trans``."""
        raw = conn.connection.dbapi_connection
        # psycopg2 is in autocommit mode on this connection: the transaction is kstore's own,
        # begun with the batch's first round trip (kstore.db.dbapi), so the processor's Python
        # before it never counts as idle in transaction. Inside the block the processor's own
        # commit() or rollback() on the DBAPI connection is refused.
        with dbapi.in_batch(raw, dbapi.BEGIN_BATCH if one_trip else None):
            write(conn)
        if dbapi.ended(raw):
            raise TransactionEnded("a statement of the batch left the server outside its transaction")
        refused = dbapi.refusal(raw)
        if refused is not None:  # even if the processor caught it: its intent was not carried out
            raise _HandlerFailed(str(refused)) from refused
        if not trans.is_active:
            # session.rollback() in the processor ended the batch's whole transaction: a
            # processor failure (isolated, then retried or dead-lettered), said plainly.
            raise _HandlerFailed("the processor rolled back the batch's transaction (session.rollback()); "
                                 "to undo part of a batch use a savepoint: with self.session.begin_nested(): ...")

    def _fenced_now(self, positions: Mapping[TP, Position]) -> set[TP]:
        """The partitions of a fenced one-round-trip commit (nothing of it landed): those whose
        rows no longer hold this batch's start under its epoch, read back now. A read that fails
        raises the database's error: the batch is then retried like any other not committed."""
        landed, moved = _outcome(positions, self.store.rows(self.group, partitions=list(positions)))
        if landed:  # the server raised before COMMIT: this cannot be; never take it for committed
            log.error("a fenced commit's rows hold its end: %s", _describe(positions))
        return moved or set(positions)

    def _batch_connection(self) -> Connection:
        """The connection batches run on, checked out once and kept.

        Checking a connection out of the pool and back in for every batch costs CPU
        and, worse, a reset (ROLLBACK) that releases the GIL: under a busy fetch
        thread, getting it back can take a whole switch interval (5 ms) per batch.
        """
        conn = self._batch_conn
        if conn is not None and conn.in_transaction():
            # Something began a transaction outside a batch (it must not have: the
            # processor's session is closed between batches); never build on it.
            log.error("the batch connection was left inside a transaction outside a batch: replacing it")
            self._drop_batch_connection()
            conn = None
        if conn is None:
            options: dict[str, object] = dict(WRITES)
            if self.store.one_round_trip_commit:
                options["isolation_level"] = "AUTOCOMMIT"  # kstore sends BEGIN and COMMIT itself
            conn = self._batch_conn = self.store.engine.connect().execution_options(**options)
        return conn

    def _drop_batch_connection(self) -> None:
        conn, self._batch_conn = self._batch_conn, None
        if conn is not None:
            try:
                # Rolls back anything open (kstore's own BEGIN included: see
                # kstore.db.store._no_transaction_back_into_the_pool) and returns it to the pool.
                conn.close()
            except Exception as exc:
                # A connection the server dropped can fail its way back into the pool (psycopg2 raises
                # while SQLAlchemy resets its isolation level): discard it instead, so the pool keeps its slot.
                log.debug("closing the batch connection failed: %s", first_line(exc))
                with contextlib.suppress(Exception):
                    conn.invalidate()

    def _decode(self, taken: _Batch) -> tuple[_Batch, _Decoded]:
        """The batch as the processor sees it (see :meth:`_messages`); with on_error=stop, cut before
        a message that cannot be deserialized (see :meth:`_before_undecodable`)."""
        decoded = self._messages(taken.records)
        if decoded.undecodable and self.on_error != "dead_letter":
            return self._before_undecodable(taken, decoded)
        return taken, decoded

    def _messages(self, batch: Sequence[Record]) -> _Decoded:
        """The batch as the processor sees it. Raw bytes: built by C loops, no Python call per message.

        Deserializing is per message, so its failure is that message's own: it is set aside with
        a :class:`DeserializationError` (never the batch's failure, found by narrowing the batch
        down). A :class:`Retry` raised by a custom ``deserialize`` fails the batch, retried as usual.
        """
        if self._raw:
            if self.source.queues_messages:  # built by the fetch thread already
                return _Decoded(cast(list[Message], list(batch)), batch, [])
            # tuple.__new__ mapped straight, not through a partial: a sixth less per message.
            return _Decoded(list(map(tuple.__new__, itertools.repeat(Message), map(_message_fields, batch))), batch, [])
        deserialize = self.processor.deserialize
        messages: list[Message] = []
        undecodable: list[tuple[Record, Exception]] = []
        weighed = 0  # messages[:weighed] are told to self.unknown_ids already (as decoded)
        for r in batch:
            try:
                key, value = deserialize(r.key, r.value)
            except Retry as exc:
                raise _HandlerFailed(str(exc)) from exc
            except RegistryUnavailableError:
                raise  # an outage: the batch waits (never the record's fault)
            except Exception as exc:
                if isinstance(exc, UnknownSchemaError):
                    weighed = self._weigh_unknown(r, exc, messages, weighed)
                undecodable.append((r, DeserializationError.of(exc)))
                continue
            messages.append(_new_message((r.topic, r.partition, r.offset, key, value, r.headers, timestamp_ms(r))))
        self.unknown_ids.decoded(set(map(_topic_of, messages[weighed:] if weighed else messages)))
        if not undecodable:
            return _Decoded(messages, batch, [])
        bad = {id(r) for r, _ in undecodable}
        return _Decoded(messages, [r for r in batch if id(r) not in bad], undecodable)

    def _weigh_unknown(self, record: Record, exc: UnknownSchemaError, messages: list[Message], weighed: int) -> int:
        """A record names a schema id the registry does not have: raise the outage it is a sign of (the
        registry knows nothing of its topic, or several ids in a row: see :mod:`kstore.schemas.unknown`),
        else leave it the record's fault. The messages decoded since the last one weighed are told
        first (they break a row of unknown ids); returns how many messages are told now."""
        self.unknown_ids.decoded(set(map(_topic_of, messages[weighed:])))
        outage = self.unknown_ids.blame(record.topic, exc)
        if outage is not None:
            raise outage from exc
        return len(messages)

    def _before_undecodable(self, taken: _Batch, decoded: _Decoded) -> tuple[_Batch, _Decoded]:
        """With on_error=stop: the batch cut before each partition's first message that cannot be
        deserialized (the rest goes back to the queues), so what precedes it commits and the stored
        offset ends up just before it; once such a message is first in its partition, the worker stops.
        """
        cut: dict[TP, tuple[Record, Exception]] = {}
        for record, error in decoded.undecodable:
            cut.setdefault((record.topic, record.partition), (record, error))
        kept = {tp: [r for r in decoded.records if (r.topic, r.partition) == tp and r.offset < record.offset]
                for tp, (record, _) in cut.items()}
        blocked = next((tp for tp, records in kept.items() if not records), None)
        if blocked is not None:
            self._requeue(taken)
            record, error = cut[blocked]
            raise ProcessorError(
                f"processor {type(self.processor).__name__} cannot deserialize {record.topic}[{record.partition}] "
                f"offset {record.offset}: {error}; its offset was not committed (on_error=stop)") from error.__cause__
        ends = {tp: record.offset for tp, (record, _) in cut.items()}
        self.partitions.requeue([r for r in taken.records if not _before(r, ends)], taken.generations)
        records = [r for r in decoded.records if _before(r, ends)]
        positions = {tp: pos._replace(next=ends.get(tp, pos.next)) for tp, pos in taken.positions.items()}
        return (_Batch(records, taken.generations, positions),
                _Decoded([m for m in decoded.msgs if _before(m, ends)], records, []))

    def _on_fenced(self, fenced: set[TP], positions: Mapping[TP, Position]) -> None:
        """Some rows no longer carry our epoch (or our offset); the transaction was rolled back.

        A partition this worker reset itself meanwhile is still ours (the reset
        already flushed and sought it). For the others, the row says whether an
        operator moved it (adopt the new position) or another worker claimed it
        (drop it); the rest of the batch is retried under the same epochs. If the
        row cannot be read now, the partition stays as it is: its next commit is
        fenced again, and the periodic epoch check retries.
        """
        self.metrics.fenced()
        lost = self.ledger.still_ours(fenced, positions)
        with self.partitions.lock:
            # Dropped by a rebalance while the batch ran (librdkafka tells a woken zombie at once that
            # its session expired): nothing to re-read, but the fence is said all the same.
            gone = [tp for tp in fenced if tp not in self.ledger.owned and tp not in self.ledger.held]
        if gone:
            log.warning("fenced on %s, no longer assigned here: rolled back", fmt(gone))
        if lost:
            log.warning("fenced on %s: their epoch or offset moved; rolled back", fmt(lost))
            try:
                self._recheck(lost)
            except (SQLAlchemyError, BrokerError, CommitInDoubtError) as exc:
                self.db_backoff.failed(f"re-read the rows of {fmt(lost)}", exc)


def _before(item: Record | Message, ends: Mapping[TP, int]) -> bool:
    """Whether a record or message lies before its partition's end in ``ends`` (or has none there)."""
    end = ends.get((item.topic, item.partition))
    return end is None or item.offset < end


def _ended(exc: TransactionEnded) -> ProcessorContractError:
    return ProcessorContractError(
        "the processor ended the batch's transaction itself (a COMMIT or ROLLBACK sent through SQL): the batch's "
        "offsets were not committed, but what it committed before may have landed, and retrying it could apply "
        f"that twice, so the worker stops ({exc}); write through self.session and never end its transaction")


def _first(taken: _Batch) -> MessageKey:
    r = taken.records[0]
    return r.topic, r.partition, r.offset


def _fields(record: Record) -> dict[str, object]:
    """A log record's fields for one message (``--log-format json`` shows them)."""
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset}


def _cause(exc: BaseException) -> Exception:
    """The error behind kstore's wrappers (the processor's, or the database's)."""
    cause = exc.__cause__ if isinstance(exc, (_HandlerFailed, _CommitInDoubt)) else exc
    return cause if isinstance(cause, Exception) else exc  # type: ignore[return-value]


def _outcome(positions: Mapping[TP, Position], rows: Mapping[TP, Row]) -> tuple[bool, set[TP]]:
    """Whether a transaction that moved ``positions`` landed, from its rows read back; and
    the partitions whose rows moved on since (another epoch, or an offset that is neither
    the batch's start nor its end): those tell nothing about it and are fenced now."""
    landed, moved = False, set()
    for tp, (start, end, epoch) in positions.items():
        row = rows.get(tp)
        if row is not None and row.epoch == epoch and row.next_offset == end:
            landed = True
        elif row is None or row.epoch != epoch or row.next_offset != start:
            moved.add(tp)
    return landed, moved


def _describe(positions: Mapping[TP, Position]) -> str:
    return ", ".join(f"{t}[{p}] {start}..{end - 1}" for (t, p), (start, end, _) in sorted(positions.items()))
