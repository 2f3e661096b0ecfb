"""One batch at a time: take it, run the processor and commit its offsets in one transaction
(:mod:`kstore.engine.commit`), and when the processor fails on it, ask the failure strategy what
to do (:mod:`kstore.engine.strategies`: narrow it down, retry, dead-letter, stop). An outage (the
database, an output topic, the schema registry) is never a message's failure: it is waited out here.

:class:`Batches` runs on the worker's main thread; the worker owns the partitions
(claims, epochs, resets) and hands this the callbacks it needs when a commit is fenced.
A commit whose answer was lost is settled (read back) before anything else is processed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from kstore.db.sqlerrors import first_line
from kstore.db.store import Store
from kstore.errors import (
    BrokerError,
    CommitInDoubtError,
    MissingTopicError,
    ProcessorContractError,
    RegistryUnavailableError,
)
from kstore.kafka.seam import ConsumerSource
from kstore.processor import Processor
from kstore.relay.store import Outbox
from kstore.retry import Failure
from kstore.running.handler import NOT_THE_MESSAGE, Concurrency, Outgoing, run_handler
from kstore.running.hooks import call_hook, dead_letter_topic, is_async_processor
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics
from kstore.telemetry.tracing import Tracing
from kstore.types import Message, Position, Produced, Record
from kstore.types import TopicPartition as TP

from . import strategies
from .backoff import Backoff
from .commit import CommitInDoubt, CommitUnit, HandlerFailed, describe
from .decoding import Batch, Decoded, Decoder
from .failures import Failures
from .ownership import Ledger, fmt
from .strategies import AGAIN, Instead
from .waits import Outages

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _InDoubt:
    """A transaction whose COMMIT raised: it may have landed or not, and is settled by reading back."""

    taken: Batch
    #: The messages as the processor saw them (for on_committed), empty for a transaction in a batch's place.
    msgs: Sequence[Message]
    #: The COMMIT's own error (the reason to retry, should it not have landed).
    cause: Exception
    what: str
    #: The messages it dead-lettered, with their failures (for the dead-letter breaker).
    letters: Sequence[tuple[Record, Failure]]
    #: Counts it in the metrics, should it have landed.
    count: Callable[[], None]


class _BatchInDoubt(Exception):
    """A batch's COMMIT raised (see :class:`~kstore.engine.commit.CommitInDoubt`), with what it carried."""

    def __init__(self, msgs: Sequence[Message], letters: Sequence[tuple[Record, Failure]], cause: Exception) -> None:
        super().__init__(str(cause))
        #: The batch's messages as the processor saw them, and those it dead-lettered.
        self.msgs, self.letters, self.cause = msgs, letters, cause


class Batches:
    """Takes, processes and commits batches for one worker, and asks the failure strategy about their failures."""

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
        #: The outages batches wait out; the worker reads the topic's and the registry's for /readyz.
        self.outages = Outages(self.metrics, db_backoff)
        self.topic_wait, self.registry_wait = self.outages.topic, self.outages.registry
        #: The batch's messages as the processor sees them.
        self.decoder = Decoder(processor, source)
        #: The batch's transaction, its offsets' compare-and-set and the read back of a lost answer.
        self.commit = CommitUnit(store, group, ledger)
        self._recheck = recheck
        policy = processor.retry
        if settings.max_attempts is not None:
            policy = dataclasses.replace(policy, max_attempts=settings.max_attempts)
        self.failures = Failures(policy, settings.log_statement_parameters)
        self.on_error = settings.on_error or processor.on_error
        letters_topic = dead_letter_topic(processor, settings)
        if letters_topic is not None and outbox is None:
            raise ProcessorContractError("dead_letter_topic needs the outbox: this runner has none")
        #: What a processor failure does to a batch, by on_error (see kstore.engine.strategies).
        self.strategy = strategies.chain(
            self.on_error, processor_name=type(processor).__name__, settings=settings, group=group,
            metrics=self.metrics, failures=self.failures, outbox=outbox, dead_letter_topic=letters_topic,
            requeue=self.partitions.requeue)
        #: Why the dead-letter breaker paused the worker (dead_letter_breaker=pause): no batch is taken.
        self.paused: str | None = None
        #: An async processor's batches: how many at once, in what order, and bounded by the liveness
        #: timeout (a handler that never returns fails its batch, which is then narrowed down).
        self._concurrency = (Concurrency.of(processor, settings.max_concurrency, settings.ordering,
                                            settings.liveness_timeout_s)
                             if is_async_processor(processor) else None)
        #: True while a batch's transaction is open (for the CLI's shutdown timeout).
        self.busy = False
        #: The last batch taken was at least half of the batch size: a backlog, where batches linger.
        self._draining = False
        #: A commit whose outcome is unknown: nothing else is processed until it is settled.
        self.in_doubt: _InDoubt | None = None
        #: The records of the last batch taken (read by the metrics' lag, from another thread, under the
        #: partitions' lock); once committed they lie below the stored offsets and the lag ignores them.
        self.in_flight: Sequence[Record] = ()

    def ready(self) -> bool:
        """False while a failed message or the database waits for its next attempt, or the breaker paused."""
        return self.paused is None and self.failures.ready() and self.outages.ready()

    def due_in(self) -> float | None:
        """Seconds until :meth:`ready` turns true by itself (0 if it is), or None while the breaker
        paused the worker (nothing ends that wait but a restart)."""
        if self.paused is not None:
            return None
        due = max(self.failures.not_before, self.outages.not_before)
        return max(0.0, due - time.monotonic())

    def close(self) -> None:
        self.commit.drop()

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
        if not self.outages.probe(taken.first(), self.commit.probe):
            self._requeue(taken)
            return False
        self._draining = 2 * len(taken.records) >= size
        started = time.monotonic()
        try:
            taken, decoded = self._decode(taken)
            fenced, msgs, letters = self._transact(taken, decoded)
        except _BatchInDoubt as exc:
            # Counted as a batch should it have landed (one whose every message was set aside, as a dead letter).
            count = (functools.partial(self.metrics.committed, taken.counts()) if exc.msgs
                     else self.metrics.dead_lettered)
            self.in_doubt = _InDoubt(taken, exc.msgs, exc.cause, "a batch", exc.letters, count)
            return self._resolve()
        except (HandlerFailed, SQLAlchemyError, MissingTopicError, RegistryUnavailableError) as exc:
            if not self._failed(taken, _cause(exc), "process a batch"):
                self._requeue(taken)
            return False
        self.outages.succeeded()
        if fenced:
            self.metrics.rolled_back("fenced")
            self._on_fenced(fenced, taken.positions)
            self._requeue(taken)
            return False
        self._committed(taken)
        self.metrics.committed(taken.counts(), started, self.commit.started)
        self._notify_committed(msgs)
        self._count_letters(taken.records, letters)
        return True

    def _take(self, size: int) -> Batch | None:
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
        return Batch(records, generations, positions, counts)

    def _requeue(self, taken: Batch) -> None:
        """Messages of a batch that did not commit go back in front of their queues."""
        self.partitions.requeue(taken.records, taken.generations)

    def _committed(self, taken: Batch) -> None:
        self.outages.committed()
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
            landed, moved = self.commit.read_back(positions)
        except SQLAlchemyError as exc:
            self.db_backoff.failed(f"learn whether the commit of {doubt.what} landed (its answer was lost)", exc)
            return False
        self.in_doubt = None
        self.db_backoff.succeeded()
        if moved:
            self._on_fenced(moved, positions)
        self.metrics.in_doubt_resolved(landed)
        if landed:
            log.warning("the COMMIT of %s (%s) lost its answer (%s) but landed: not processing it again",
                        doubt.what, describe(positions), first_line(doubt.cause))
            self._committed(doubt.taken)
            self.produced(0)  # it may have produced records: a wake-up that finds none costs one query
            doubt.count()
            self._notify_committed(doubt.msgs)
            self._count_letters(doubt.taken.records, doubt.letters)
            return True
        self.metrics.rolled_back("in_doubt")
        log.warning("the COMMIT of %s (%s) lost its answer (%s) and did not land: processing it again",
                    doubt.what, describe(positions), first_line(doubt.cause))
        if not self._failed(doubt.taken, doubt.cause, f"commit {doubt.what}"):
            self._requeue(doubt.taken)
        return False

    # -- failures ---------------------------------------------------------------

    def _failed(self, taken: Batch, cause: BaseException, what: str) -> bool:
        """A batch did not commit. An outage (the database, an output topic, the schema registry) is
        waited out, the batch retried as it is (see :meth:`Outages.waited`); anything else is the
        batch's failure, for the strategy. True if the batch is settled (committed in its place, or
        in doubt): do not requeue it."""
        if self.outages.waited(taken.first(), cause, what):
            return False
        self.metrics.rolled_back("error")
        return self._handler_failed(taken, cause)

    def _handler_failed(self, taken: Batch, cause: BaseException) -> bool:
        """Ask the failure strategy what a processor failure means; True if the batch is settled
        (committed in the batch's place, or in doubt): do not requeue it."""
        verdict = self.strategy.failed(taken, cause)
        if verdict is AGAIN:
            return False
        return self._instead(taken, verdict)

    def _instead(self, taken: Batch, instead: Instead) -> bool:
        """Commit ``instead`` in the batch's place, moving its offsets past it; True if settled."""

        def write(conn: Connection) -> None:
            produced = instead.write(conn)
            if produced:
                self._produced_now = produced

        try:
            fenced = self.commit.commit(taken.positions, write)
        except CommitInDoubt as exc:
            self.in_doubt = _InDoubt(taken, (), _cause(exc), instead.what, instead.letters, instead.count)
            return True
        except SQLAlchemyError as exc:
            self.metrics.rolled_back("database")
            self.db_backoff.failed(f"write {instead.what}", exc)
            return False
        if fenced:
            self.metrics.rolled_back("fenced")
            self._on_fenced(fenced, taken.positions)
            return False
        self._committed(taken)
        instead.count()
        instead.say()
        self._count_letters(taken.records, instead.letters)
        return True

    def _count_letters(self, records: Sequence[Record], letters: Sequence[tuple[Record, Failure]]) -> None:
        """A transaction of ``records`` committed with ``letters`` dead-lettered: the strategy may pause
        the worker (the dead-letter breaker) or stop it."""
        paused = self.strategy.committed(records, letters)
        if paused is not None:
            self.paused = paused

    # -- the transaction ----------------------------------------------------------

    def _transact(self, taken: Batch, decoded: Decoded,
                  ) -> tuple[set[TP], Sequence[Message], Sequence[tuple[Record, Failure]]]:
        """The batch's transaction: the processor's writes, then its offsets (:meth:`CommitUnit.commit`).

        Returns the fenced partitions, the messages as the processor saw them and those dead-lettered
        with their failures (all three only if it committed). Messages that could not be deserialized
        (``decoded.undecodable``, only with a strategy that sets them aside) never reach the processor:
        the strategy sets them aside in this same transaction.
        """
        msgs: Sequence[Message] = decoded.msgs
        rejects: list[tuple[int, Exception]] | None = [] if self.strategy.sets_aside else None
        letters: list[tuple[Record, Failure]] = []
        outgoing = Outgoing(self._check_produced) if self.outbox is not None else None

        def handle(conn: Connection) -> None:
            nonlocal msgs
            self._handle(conn, msgs, rejects, outgoing)
            if rejects or decoded.undecodable:
                msgs = self.strategy.set_aside(conn, decoded, rejects or [], letters, outgoing)
            self._write_outgoing(conn, outgoing)

        self.busy = True
        try:
            try:
                fenced = self.commit.commit(taken.positions, handle)
                if not fenced:
                    self.strategy.set_aside_landed(letters)
                return fenced, msgs, letters
            except CommitInDoubt as exc:
                raise _BatchInDoubt(msgs, letters, _cause(exc)) from exc
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
            raise HandlerFailed(str(exc)) from exc

    def _write_outgoing(self, conn: Connection, outgoing: Outgoing | None) -> None:
        """The records the batch produced, into the outbox: last before the offsets, so the shards'
        row locks are held from here to COMMIT."""
        self._produced_now = len(outgoing.records) if outgoing is not None else 0
        if outgoing is not None and outgoing.records:
            assert self.outbox is not None
            self.outbox.write(conn, outgoing.records)

    def _decode(self, taken: Batch) -> tuple[Batch, Decoded]:
        """The batch as the processor sees it (see :meth:`Decoder.messages`); the strategy decides
        what becomes of messages that cannot be deserialized (with on_error=stop, the batch is cut
        before the first: see :class:`~kstore.engine.strategies.stop.Stop`)."""
        decoded = self.decoder.messages(taken.records)
        if decoded.undecodable:
            return self.strategy.undecodable(taken, decoded)
        return taken, decoded

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


def _cause(exc: BaseException) -> Exception:
    """The error behind kstore's wrappers (the processor's, or the database's)."""
    cause = exc.__cause__ if isinstance(exc, (HandlerFailed, CommitInDoubt)) else exc
    return cause if isinstance(cause, Exception) else exc  # type: ignore[return-value]
