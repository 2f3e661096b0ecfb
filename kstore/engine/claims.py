"""The worker's side of the group: rebalance events, claims, epoch checks, positions followed.

:class:`Claims` acts on what the group and the database say of the partitions, through the
:class:`~kstore.engine.ownership.Ledger`: the rebalance events a fetch brought (assigned partitions
become pending, revoked and lost ones are dropped and flushed at once), the one-pipeline-one-database
check before any claim (:mod:`kstore.engine.onedatabase`), the claims themselves, the periodic epoch
check (an operator's reset, another worker's claim, a fenced partition Kafka still assigns here), and
the consumer's own moves (:mod:`kstore.engine.positions`). It tells the processor what it gained and
lost (``on_assigned``, ``on_revoked``), always on the main thread.

Threads: :meth:`Claims.apply_events` runs on the fetch thread (and, where a client's callbacks run
on it, inside them: :meth:`Claims.on_rebalance`) and never touches the database; everything else
runs on the main thread (:meth:`Claims.turn`, :meth:`Claims.recheck`). A failure of the database or
the brokers leaves the partitions as they are (paused, pending) and is retried after the shared
database backoff: kstore fails closed.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.exc import SQLAlchemyError

from kstore.errors import BrokerError, CommitInDoubtError
from kstore.kafka.seam import ConsumerSource, EventKind
from kstore.processor import Processor
from kstore.relay.loop import Relay
from kstore.running.hooks import call_hook
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics
from kstore.types import TopicPartition as TP

from . import positions
from .backoff import Backoff
from .batches import Batches
from .onedatabase import OneDatabase
from .ownership import Ledger, fmt

log = logging.getLogger("kstore.engine.worker")


class Claims:
    """Rebalance events, claims, epoch checks and positions followed (see the module's docstring)."""

    def __init__(self, settings: Settings, processor: Processor, metrics: Metrics, db_backoff: Backoff,
                 ledger: Ledger, source: ConsumerSource, batches: Batches, guard: OneDatabase | None,
                 guard_backoff: Backoff, relay: Relay | None) -> None:
        self.settings = settings
        self.processor = processor
        self.metrics = metrics
        self.db_backoff = db_backoff
        self.ledger = ledger
        self.partitions = ledger.partitions
        self.source = source
        self.batches = batches
        #: One pipeline, one database (see kstore.engine.onedatabase); None for a source that cannot
        #: describe its group (a test double).
        self.guard = guard
        self.guard_backoff = guard_backoff
        self.relay = relay
        #: The group has assigned partitions (possibly none) at least once (for /readyz).
        self.assigned_once = False
        #: The client's callbacks run on the fetch thread: a revoke is applied inside them (on_rebalance).
        self._apply_at_once = source.callbacks_may_lock
        #: Partitions dropped on the fetch thread, for the processor's ``on_revoked`` on the main thread.
        self._revoked_notices: list[list[TP]] = []
        self._next_epoch_check = 0.0

    # -- the fetch thread (and the client's callbacks) ------------------------------------

    def apply_events(self) -> None:
        """On the fetcher thread: act on the rebalance events recorded during ``poll()``, in order.

        Revoked and lost partitions are flushed at once, so no record of theirs
        is delivered after; the processor hears of it on the main thread.
        """
        partitions, ledger = self.partitions, self.ledger
        events = partitions.take_events()
        if not events:
            return
        with partitions.lock:
            for kind, tps in events:
                if kind == "assigned":
                    self.metrics.rebalanced()
                    self.assigned_once = True
                    ledger.assign(tps)
                    if tps:  # (an incremental rebalance that gave this worker nothing new)
                        log.info("assigned %s; claiming before any delivery", fmt(tps))
                else:
                    dropped = ledger.drop(tps)
                    if dropped:
                        log.info("%s %s", kind, fmt(dropped))
                        self._revoked_notices.append(dropped)
            partitions.changed.notify_all()
        if self.relay is not None:
            self.relay.group_changed()

    def on_rebalance(self, kind: EventKind, tps: list[TP]) -> None:
        """A client's rebalance callback (on its own thread): post the event. Where the callbacks run
        on the fetch thread itself (librdkafka's, inside consume()), a revoke or a loss is applied
        there and then, not when consume() returns: a batch in flight sees the partition gone before
        it commits (and rolls back) instead of committing into the new owner's fence."""
        self.partitions.post(kind, tps)
        if kind != "assigned" and self._apply_at_once:
            self.apply_events()

    # -- the main thread -------------------------------------------------------------------

    def turn(self) -> bool:
        """Before each batch: tell the processor of revoked partitions, judge the group and claim
        new partitions, check epochs, follow the consumer's positions. False while the database
        fails (no batch then)."""
        self._notify_revoked()
        if self._judge_group():
            self._claim_pending()
        self._check_epochs()
        return self._follow_positions()

    def _notify_revoked(self) -> None:
        with self.partitions.lock:
            notices, self._revoked_notices = self._revoked_notices, []
        for tps in notices:
            call_hook(self.processor, "on_revoked", tps)

    def _revoked(self, tps: list[TP], why: str) -> None:
        if tps:
            log.info("%s %s", why, fmt(tps))
            call_hook(self.processor, "on_revoked", tps)

    def _judge_group(self) -> bool:
        """One pipeline, one database: after each assignment, and before claiming any of it, compare
        the group's live members with this database's workers (refuses with ConfigurationError; see
        kstore.engine.onedatabase). False until the last assignment is judged: its partitions wait, paused."""
        guard = self.guard
        if guard is None:
            return True
        if not guard.judged and not self.guard_backoff.ready():
            return False
        try:
            guard.check()
        except (SQLAlchemyError, BrokerError) as exc:
            self.guard_backoff.failed("compare the group's members with this database's workers", exc)
            return False
        self.guard_backoff.succeeded()
        return guard.judged

    def _claim_pending(self) -> None:
        """Claim newly assigned partitions, seek them to their stored offsets, resume them."""
        ledger = self.ledger
        if not ledger.pending or not self.db_backoff.ready():
            return
        started = time.monotonic()
        try:
            claimed = ledger.claim_pending()
        except (SQLAlchemyError, BrokerError, CommitInDoubtError) as exc:
            # Nothing was placed: whether the claim's COMMIT landed or not, claiming again
            # is right (a claim has no effects; a landed one only bumped an epoch).
            self.db_backoff.failed(f"claim {fmt(ledger.pending)} (they stay paused)", exc)
            return
        self.db_backoff.succeeded()
        if claimed:
            if self.guard is not None:
                self.guard.claimed()
            self.metrics.claimed(time.monotonic() - started)
            offsets = ledger.offsets()
            log.info("claimed %s", ", ".join(
                f"{t}[{p}]@{offsets.get((t, p), 'held')}" for t, p in claimed))
            if log.isEnabledFor(logging.DEBUG):
                # The epoch each claim won: a commit logged after a revoke is the batch that was in
                # flight only if it carries this epoch (the database fences any other).
                with ledger.lock:
                    epochs = {tp: ledger.owned[tp].epoch for tp in claimed if tp in ledger.owned}
                log.debug("claim epochs: %s", ", ".join(f"{t}[{p}]@{e}" for (t, p), e in sorted(epochs.items())))
            call_hook(self.processor, "on_assigned", [tp for tp in claimed if tp in offsets])

    def _check_epochs(self) -> None:
        """Every ``epoch_check_interval_s``: notice an operator's reset even on an idle partition."""
        if time.monotonic() < self._next_epoch_check:
            return
        self._next_epoch_check = time.monotonic() + self.settings.epoch_check_interval_s
        orphans = self.ledger.reclaim_orphans()
        if orphans:
            log.warning("%s still assigned here a session timeout after being fenced: claiming again", fmt(orphans))
        try:
            stale = self.ledger.stale()
            if stale:
                self.recheck(stale)
        except (SQLAlchemyError, BrokerError, CommitInDoubtError) as exc:
            self.db_backoff.failed("check the partitions' epochs", exc)
            return
        if self.ledger.owned or self.ledger.held:  # stale() asked the database: it answers
            self.db_backoff.succeeded()  # (an idle worker learns it here, not from a batch)

    def _follow_positions(self) -> bool:
        """Where the consumer moved, or could not fetch, by itself (see kstore.engine.positions): move
        stored offsets past transaction markers, place again partitions whose position left the
        log. Before any batch, so one whose answer was lost is settled first. False while the
        database fails."""
        if self.batches.in_doubt is not None or not self.db_backoff.ready():
            return True  # a batch's commit in doubt is settled first; a failing database waits
        try:
            moved = positions.advance(self.ledger)
            if moved:
                self.recheck(moved)
            for _tp, reason in positions.relocate(self.ledger):
                self.metrics.position_reset(reason)
        except (SQLAlchemyError, BrokerError, CommitInDoubtError) as exc:
            self.db_backoff.failed("follow the consumer's positions", exc)
            return False
        return True

    def recheck(self, tps: list[TP]) -> None:
        """Partitions whose stored epoch (or offset) moved: adopt an operator's reset, drop what another
        worker claimed (the processor hears ``on_revoked``). Raises SQLAlchemyError or BrokerError."""
        adopted, dropped = self.ledger.recheck(tps)
        if adopted and self.settings.mirror_offsets:
            # An operator's move, followed: Kafka's lag tools see it now, not at the next commit (a
            # partition moved to its end may have none for long).
            offsets = self.ledger.offsets()
            self.source.mirror({tp: offsets[tp] for tp in adopted if tp in offsets})
        if dropped:
            log.warning("fenced on %s: another worker claimed them; rolled back anything uncommitted", fmt(dropped))
            self._revoked(dropped, "fenced")
