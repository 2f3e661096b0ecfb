"""The commit unit: one batch's transaction on the connection batches keep, its writes, its offsets'
compare-and-set as the last statement before COMMIT, and the read back of a COMMIT whose answer was lost.

:class:`CommitUnit` runs on the worker's main thread. :meth:`CommitUnit.commit` runs ``write(conn)``
and moves each partition's ``next_offset`` in the same transaction; :meth:`CommitUnit.read_back`
says whether a transaction whose COMMIT raised landed. What it decides nothing about (what the
batch is, what a failure means, who owns a partition) stays with :mod:`kstore.engine.batches`.

Invariants, each with the harm its guard stops:

- **Epoch**: the offsets UPDATE matches ``epoch = <claimed>``: a zombie whose partition another worker
  claimed meanwhile matches nothing and rolls back, so it never commits effects for a partition it lost.
- **Position**: it also matches ``next_offset = <batch start>``: a batch run again after its COMMIT
  landed (an answer lost, and read back wrongly) matches nothing, so its effects never land twice.
- **Revoke check**: just before the offsets UPDATE, a batch holding a partition this worker stopped
  owning while it ran (revoked or lost) is rolled back whole: nothing commits for a partition the
  rebalance took, even before its new owner's claim bumps the epoch.
- **Read back**: a COMMIT that raised may have landed. :class:`CommitInDoubt` says so, and
  :meth:`CommitUnit.read_back` reads the rows on a fresh connection, waiting for their row locks (the
  COMMIT may still be running on the server): landed means committed, not landed means run again.
  Never assumed either way: a read that fails raises, and the caller waits until it can read.
- **One transaction per batch**: whatever fails before COMMIT (the processor, the database, a
  signal), the connection is dropped, so the next batch never builds on a broken or open transaction.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from kstore.db import dbapi
from kstore.db.sqlerrors import first_line
from kstore.db.store import FencedCommit, Row, Store, TransactionEnded
from kstore.db.writes import WRITES
from kstore.errors import ProcessorContractError
from kstore.types import Position
from kstore.types import TopicPartition as TP

#: The batches' logger: these lines are a batch's, as they always were.
log = logging.getLogger("kstore.engine.batches")


class CommitInDoubt(Exception):
    """The COMMIT itself raised: the server may or may not have committed (see :meth:`CommitUnit.read_back`)."""


class HandlerFailed(Exception):
    """The processor (or deserializing a message) raised, or broke the batch's transaction; wraps the original."""


class Revocations(Protocol):
    """Which partitions of a batch this worker stopped owning while it ran (the ledger's answer)."""

    def dropped(self, positions: Mapping[TP, Position]) -> set[TP]: ...


class CommitUnit:
    """One batch's transaction, from its first write to its COMMIT, and the read back of a lost answer."""

    def __init__(self, store: Store, group: str, ledger: Revocations) -> None:
        self.store, self.group, self.ledger = store, group, ledger
        #: When the last commit sent its offsets UPDATE (a batch's commit duration starts there).
        self.started = 0.0
        #: The connection batches run on, held from one batch to the next (see :meth:`connection`).
        self._conn: Connection | None = None

    def commit(self, positions: Mapping[TP, Position], write: Callable[[Connection], None]) -> set[TP]:
        """One transaction: ``write(conn)``, then the compare-and-set of each partition's offset.

        Returns the fenced partitions (the transaction was rolled back) or an empty set
        (committed). Raises what ``write`` or the database raised before COMMIT (nothing
        landed), or :class:`CommitInDoubt` if the COMMIT itself raised (it may have).
        """
        one_trip = self.store.one_round_trip_commit
        conn = self.connection()
        try:
            trans = conn.begin()
            self._write(conn, trans, write, one_trip)
            fenced = self._before_commit(conn, trans, positions, one_trip)
            if fenced:
                return fenced
        except TransactionEnded as exc:
            self.drop()
            raise ended(exc) from exc
        except BaseException:
            # Whatever failed (the processor, the database, a signal), start the next
            # batch on a fresh connection: this one may be broken or mid-transaction.
            self.drop()
            raise
        try:
            if one_trip:
                # The compare-and-set and COMMIT in one round trip (kstore.db.store): a fenced one
                # raises in the server before its COMMIT; any other error may have come after it.
                # (If nothing of the batch touched the database, its BEGIN rides in this message too.)
                self.store.commit_in_one_round_trip(conn, self.group, positions)
            trans.commit()  # sends COMMIT, except after the one-trip commit (psycopg2 in autocommit mode)
        except FencedCommit:
            self.drop()
            return self._fenced_now(positions)
        except TransactionEnded as exc:
            self.drop()
            raise ended(exc) from exc
        except Exception as exc:
            # The COMMIT was sent, or may have been: the server may have committed and
            # its answer been lost. Never assume either way (see read_back).
            self.drop()
            raise CommitInDoubt(str(exc)) from exc
        except BaseException:
            self.drop()
            raise
        return set()

    def read_back(self, positions: Mapping[TP, Position]) -> tuple[bool, set[TP]]:
        """Whether the transaction that moved ``positions`` landed, read back on a fresh connection; and
        the partitions whose rows moved on since (see :func:`_outcome`). Raises the database's error if
        the rows cannot be read: the outcome stays unknown."""
        # Waiting for the rows' locks: the COMMIT may still be running on the server (cut by the
        # deadline, say), and a plain read would not see it yet and call it "did not land".
        rows = self.store.rows(self.group, partitions=list(positions), wait_for_locks=True)
        return _outcome(positions, rows)

    def probe(self) -> None:
        """``SELECT 1`` on the batch connection; raises the database's error (the connection is dropped)."""
        try:
            conn = self.connection()
            conn.exec_driver_sql("SELECT 1")
            conn.rollback()
        except SQLAlchemyError:
            self.drop()
            raise

    def _before_commit(self, conn: Connection, trans: Any, positions: Mapping[TP, Position], one_trip: bool) -> set[TP]:
        """After the batch's writes: the partitions it must not commit (the transaction is rolled
        back), or none. Without the one-trip commit, the offsets' compare-and-set goes here."""
        gone = self.ledger.dropped(positions)
        if gone:
            # Revoked or lost while the batch ran (an incremental rebalance takes some partitions and
            # leaves the rest): nothing of the batch commits; the rest of it is retried. A revoke
            # after this check is met by the epoch (the new owner's claim fences the commit).
            self.drop()
            return gone
        self.started = time.monotonic()
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
            raise HandlerFailed(str(refused)) from refused
        if not trans.is_active:
            # session.rollback() in the processor ended the batch's whole transaction: a
            # processor failure (isolated, then retried or dead-lettered), said plainly.
            raise HandlerFailed("the processor rolled back the batch's transaction (session.rollback()); "
                                "to undo part of a batch use a savepoint: with self.session.begin_nested(): ...")

    def _fenced_now(self, positions: Mapping[TP, Position]) -> set[TP]:
        """The partitions of a fenced one-round-trip commit (nothing of it landed): those whose
        rows no longer hold this batch's start under its epoch, read back now. A read that fails
        raises the database's error: the batch is then retried like any other not committed."""
        landed, moved = _outcome(positions, self.store.rows(self.group, partitions=list(positions)))
        if landed:  # the server raised before COMMIT: this cannot be; never take it for committed
            log.error("a fenced commit's rows hold its end: %s", describe(positions))
        return moved or set(positions)

    def connection(self) -> Connection:
        """The connection batches run on, checked out once and kept.

        Checking a connection out of the pool and back in for every batch costs CPU
        and, worse, a reset (ROLLBACK) that releases the GIL: under a busy fetch
        thread, getting it back can take a whole switch interval (5 ms) per batch.
        """
        conn = self._conn
        if conn is not None and conn.in_transaction():
            # Something began a transaction outside a batch (it must not have: the
            # processor's session is closed between batches); never build on it.
            log.error("the batch connection was left inside a transaction outside a batch: replacing it")
            self.drop()
            conn = None
        if conn is None:
            options: dict[str, object] = dict(WRITES)
            if self.store.one_round_trip_commit:
                options["isolation_level"] = "AUTOCOMMIT"  # kstore sends BEGIN and COMMIT itself
            conn = self._conn = self.store.engine.connect().execution_options(**options)
        return conn

    def drop(self) -> None:
        """Give the batch connection back (the next batch checks out a fresh one)."""
        conn, self._conn = self._conn, None
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


def ended(exc: TransactionEnded) -> ProcessorContractError:
    return ProcessorContractError(
        "the processor ended the batch's transaction itself (a COMMIT or ROLLBACK sent through SQL): the batch's "
        "offsets were not committed, but what it committed before may have landed, and retrying it could apply "
        f"that twice, so the worker stops ({exc}); write through self.session and never end its transaction")


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


def describe(positions: Mapping[TP, Position]) -> str:
    """Partitions and the offsets a transaction moves over, for a log line."""
    return ", ".join(f"{t}[{p}] {start}..{end - 1}" for (t, p), (start, end, _) in sorted(positions.items()))
