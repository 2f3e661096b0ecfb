"""One batch at a time: take it, run the processor and commit its offsets in one
transaction, and deal with what goes wrong (fencing, processor failures, retries in
smaller batches, dead letters, the database going away).

:class:`Batches` runs on the worker's main thread; the worker owns the partitions
(claims, epochs, resets) and hands this the callbacks it needs when a commit is fenced.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Mapping, Sequence

from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from . import deadletters
from .consumer import TP, KafkaSource, Record
from .errors import ProcessorError
from .ownership import Backoff, Ledger, fmt
from .processor import Message, Processor, run_handler
from .retry import Failure, Failures
from .settings import Settings
from .store import Store

log = logging.getLogger(__name__)


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


class Batches:
    """Takes, processes and commits batches for one worker, and handles their failures."""

    def __init__(
        self,
        processor: Processor,
        settings: Settings,
        group: str,
        store: Store,
        source: KafkaSource,
        ledger: Ledger,
        db_backoff: Backoff,
        recheck: Callable[[list[TP]], None],
        revoked: Callable[[list[TP], str], None],
    ) -> None:
        self.processor = processor
        self.settings = settings
        self.group = group
        self.store, self.source, self.ledger = store, source, ledger
        #: Shared with the worker's claims and checks: one database, one backoff.
        self.db_backoff = db_backoff
        self._recheck, self._revoked = recheck, revoked
        policy = processor.retry
        if settings.max_attempts is not None:
            policy = dataclasses.replace(policy, max_attempts=settings.max_attempts)
        self.failures = Failures(policy)
        self.on_error = settings.on_error or processor.on_error
        # Raw bytes with the default deserialize(): skip a call per message.
        self._raw = (type(processor).deserialize is Processor.deserialize
                     and processor.key_format == "bytes" and processor.value_format == "bytes")
        self._dead_letters = deadletters.build_table(settings.table_prefix, settings.schema)
        #: True while a batch's transaction is open (for the CLI's shutdown timeout).
        self.busy = False
        #: The connection batches run on, held from one batch to the next (see _batch_connection).
        self._batch_conn: Connection | None = None

    def ready(self) -> bool:
        """False while a failed message or the database waits for its next attempt."""
        return self.failures.ready() and self.db_backoff.ready()

    def close(self) -> None:
        self._drop_batch_connection()

    def process_next(self) -> bool:
        """Take one batch and process it; True if a batch committed."""
        if not self.ready():
            return False  # a failed message or the database waits for its next attempt; fetching goes on
        size = self.failures.batch_size(self.settings.max_batch_size)
        if self.settings.batch_linger_ms and 0 < self.source.queued() < size:
            self.source.wait_for(size, self.settings.batch_linger_ms / 1000)
        taken = self._take(size)
        if taken is None:
            return False
        try:
            fenced, msgs = self._transact(taken.records, taken.positions)
        except _HandlerFailed as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, OperationalError):
                self.db_backoff.failed("process a batch", cause)
            elif self._handler_failed(taken.records, cause, taken.epochs):
                return False  # settled: dead-lettered
            self._requeue(taken)
            return False
        except SQLAlchemyError as exc:
            self._requeue(taken)
            self.db_backoff.failed("commit a batch", exc)
            return False
        self.db_backoff.succeeded()
        if fenced:
            self._on_fenced(fenced, taken.epochs)
            self._requeue(taken)
            return False
        self._committed(taken)
        self._notify_committed(msgs)
        return True

    def _take(self, size: int) -> _Batch | None:
        """The next batch, with what it needs to commit (epochs) or to be put back (generations)."""
        source, ledger = self.source, self.ledger
        with source.lock:
            self.failures.retain(ledger.owned)
            records, ends = source.take_batch(size)
            if not records:
                return None
            generations = {tp: source.generation(tp) or 0 for tp in ends}
            epochs = ledger.epochs(ends)
        positions = {tp: (end, epochs[tp]) for tp, end in ends.items()}
        return _Batch(records, generations, epochs, positions)

    def _requeue(self, taken: _Batch) -> None:
        """Messages of a batch that did not commit go back in front of their queues."""
        self.source.requeue(taken.records, taken.generations)

    def _committed(self, taken: _Batch) -> None:
        self.ledger.committed(taken.positions)
        if self.failures.active:
            self.failures.done([(r.topic, r.partition, r.offset) for r in taken.records])
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
        failures = self.failures
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
            self.db_backoff.failed("write a dead letter", exc)
            return False
        if fenced:
            self._on_fenced(fenced, epochs)
            return False
        self.ledger.committed(positions)
        self.failures.done([(record.topic, record.partition, record.offset)])
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
        store = self.store
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
            self._batch_conn = self.store.engine.connect()
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
        lost = self.ledger.still_ours(fenced, epochs)
        if lost:
            log.warning("fenced on %s: their epoch moved; rolled back", fmt(lost))
            try:
                self._recheck(lost)
            except SQLAlchemyError:
                self._revoked(self.ledger.drop(lost, pause=True), "fenced")
