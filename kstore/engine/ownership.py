"""Which partitions this worker holds, at which epoch, and where each one reads from.

The ledger behind the worker: claiming assigned partitions, placing each at its
stored offset (or the start policy), holding back a partition whose stored offset
lies past the log end, adopting an operator's reset, dropping a partition another
worker claimed, and ``reset_offsets``. The state itself is
:class:`~kstore.engine.partitions.Partitions`' (one state per partition: pending, owned, held or
fenced, with its queue), changed only by its transitions; every change of position happens under its
lock, together with the flush and seek of the partition's queue.

Invariants (besides those of :mod:`kstore.engine.partitions`):

- ``owned[tp].committed`` is the ``next_offset`` stored for ``tp`` under
  ``owned[tp].epoch``: set from the row when claimed or reset, moved only by a
  commit this worker saw land. A batch's commit expects it (compare-and-set).
- Nothing is placed (sought, resumed) before the transaction that claimed it
  has answered; a partition revoked while a claim or a re-check ran is not
  placed again (they re-check ``pending``/``owned`` under the lock).
- A partition Kafka assigns is pending until claimed; it leaves pending only by its claim or its
  revoke (a momentarily empty assignment mid-rebalance does not make the worker forget it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from kstore.db.store import Claim, Row, Store
from kstore.engine.partitions import Owned, Partitions
from kstore.errors import FencedError, InvalidOffsetError, KstoreError
from kstore.kafka.seam import ConsumerSource
from kstore.settings import Settings, parse_start_policy
from kstore.targets import Target, check_target, policy_offset
from kstore.types import Position
from kstore.types import TopicPartition as TP

log = logging.getLogger("kstore.engine.worker")


@dataclass(frozen=True)
class _Plan:
    """Where a claimed (or reset) partition starts, decided before it is placed."""

    epoch: int
    #: The offset stored in the row (None: never stored).
    stored: int | None
    #: Where delivery starts; None: held (stored offset past the log end).
    offset: int | None
    #: Why it does not start at the stored offset (for the history and the log).
    why: str | None = None
    #: Messages skipped because retention deleted them, said loudly.
    lost: str | None = None


def fmt(tps: Iterable[TP]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in sorted(tps)) or "nothing"


class Ledger:
    """Owned, held and pending partitions of one worker."""

    def __init__(self, settings: Settings, group: str, worker_id: str, store: Store, source: ConsumerSource,
                 partitions: Partitions) -> None:
        self.settings = settings
        self.group = group
        self.worker_id = worker_id
        self.store = store
        self.source = source
        self.partitions = partitions
        self.policy = parse_start_policy(settings.start_from)
        # The partitions' state, by the names the ledger's decisions read (read-only views of it).
        self.owned = partitions.owned
        self.held = partitions.held
        self.pending = partitions.pending
        self.fenced_at = partitions.fenced_at

    @property
    def lock(self) -> threading.RLock:
        """The partitions' lock: every change of position is made under it."""
        return self.partitions.lock

    # -- claiming ---------------------------------------------------------------

    def claim_pending(self) -> list[TP]:
        """Claim the pending partitions still assigned and place each one; returns them.

        Raises SQLAlchemyError (database) or KafkaError (log bounds) on failure: the
        partitions then stay paused and pending, and kstore never falls back to
        Kafka's own offsets. Nothing is placed before the claim's transaction has
        committed, so no record is delivered under a claim that may not have landed.
        """
        assigned = self.source.assignment()
        with self.lock:
            # Claim what Kafka assigns now. The rest stays pending, not discarded: a
            # partition leaves pending only by its revoke event (a momentarily empty
            # assignment mid-rebalance must not make the worker forget a partition).
            tps = sorted(tp for tp in self.pending if tp in assigned)
        if not tps:
            return []
        # Asked of the brokers before the claim, so the claim's transaction (and its
        # row locks) never waits on Kafka.
        bounds = self.source.log_bounds(tps)
        times = self._policy_times(tps)
        with self.store.claiming(self.group, tps, self.worker_id) as (conn, claims):
            plans = {tp: self._plan(tp, claims[tp], bounds[tp], times.get(tp)) for tp in tps}
            for tp, plan in plans.items():
                self._persist(conn, tp, plan)
        with self.lock:
            # Revoked while the claim ran: the fetcher thread already dropped it from pending.
            tps = [tp for tp in tps if tp in self.pending]
            for tp in tps:
                self._apply(tp, plans[tp])  # out of pending: owned or held
        return tps

    def _plan(self, tp: TP, claim: Claim, bounds: tuple[int, int], policy_found: int | None) -> _Plan:
        """Where a claimed partition starts: its stored offset, the start policy, or nowhere (held)."""
        start, end = bounds
        stored, epoch = claim.next_offset, claim.epoch
        if stored is not None and start <= stored <= end:
            return _Plan(epoch, stored, stored)
        if stored is not None and stored > end:
            why = (f"stored offset {stored} is past the log end {end} (topic recreated?): partition held, "
                   f"nothing consumed until `kstore offsets set --group {self.group} --topic {tp[0]} "
                   f"--partition {tp[1]} ... --execute`")
            return _Plan(epoch, stored, None, why)
        offset = policy_offset(self.policy, bounds, policy_found)
        if stored is None:
            return _Plan(epoch, stored, offset, f"no stored offset: start_from={self.settings.start_from}")
        return _Plan(epoch, stored, offset,
                     f"stored offset {stored} is below the log start {start} (deleted by retention?): "
                     f"start_from={self.settings.start_from}",
                     lost=f"MESSAGES {stored}..{start - 1} WERE NEVER PROCESSED")

    def _persist(self, conn: Connection, tp: TP, plan: _Plan) -> None:
        """Inside the claim: store a start that is not the stored offset (so a restart before
        the first commit resumes there, not at a "latest" resolved again later), or note a hold."""
        if plan.offset is None:
            self.store._record(conn, self.group, tp, plan.stored, plan.stored, plan.epoch, plan.why or "held")
        elif plan.offset != plan.stored:
            self.store.start_at(conn, self.group, tp, plan.offset, plan.epoch, plan.why or "", plan.stored)

    def _apply(self, tp: TP, plan: _Plan) -> None:
        """Deliver ``tp`` from the plan's offset, or hold it. Lock held; the plan is stored."""
        if plan.offset is None:
            assert plan.stored is not None
            log.error("%s[%d]: %s", tp[0], tp[1], plan.why)
            self.partitions.hold(tp, plan.epoch)
            return
        if plan.lost:
            log.warning("%s[%d]: %s; %s; starting at %d", tp[0], tp[1], plan.why, plan.lost, plan.offset)
        self.partitions.own(tp, Owned(plan.epoch, plan.offset), plan.offset)

    def _policy_times(self, tps: list[TP]) -> dict[TP, int | None]:
        """For a ``start_from`` time: the first offset at or after it, per partition."""
        if not isinstance(self.policy, datetime):
            return {}
        return self.source.offsets_for_times({tp: self.policy for tp in tps})

    def _policy_offset(self, tp: TP, bounds: tuple[int, int]) -> int:
        found = self.source.offsets_for_times({tp: self.policy}) if isinstance(self.policy, datetime) else {}
        return policy_offset(self.policy, bounds, found.get(tp))

    # -- gaining, losing and re-checking ------------------------------------------

    def assign(self, tps: Iterable[TP]) -> None:
        """Kafka assigned ``tps`` here: pending, claimed by :meth:`claim_pending` before any delivery.

        A partition assigned again while this worker still holds it (no revoke came between: no
        rebalance protocol does that, but a client's bug or a lost callback might) is taken as
        revoked first, so it is flushed and claimed again rather than stopping the worker."""
        with self.lock:
            tps = list(tps)
            again = [tp for tp in tps if tp in self.owned or tp in self.held]
            if again:
                log.warning("assigned %s again without a revoke: claiming them again", fmt(again))
                self.partitions.revoke(again)
            self.partitions.assign(tps)

    def drop(self, tps: Iterable[TP]) -> list[TP]:
        """Forget partitions Kafka revoked or this worker lost (nothing to claim again later);
        returns those that were delivered."""
        return self.partitions.revoke(tps)

    def fence(self, tps: Iterable[TP]) -> list[TP]:
        """Drop owned or held partitions another worker claimed, noting when (see
        :meth:`reclaim_orphans`); returns those that were delivered."""
        return self.partitions.fence(tps, time.monotonic())

    def stale(self) -> list[TP]:
        """Partitions whose stored epoch is no longer ours (one query): an admin reset or another owner."""
        with self.lock:
            ours = {tp: o.epoch for tp, o in self.owned.items()} | dict(self.held)
        rows = self.store.rows(self.group, partitions=ours)
        return [tp for tp, epoch in ours.items() if tp in rows and rows[tp].epoch != epoch]

    def recheck(self, tps: Iterable[TP]) -> tuple[list[TP], list[TP]]:
        """Re-read rows whose epoch moved: adopt an operator's reset, drop what another worker claimed.

        Returns ``(adopted, dropped)``. An admin reset keeps the row's owner,
        a claim by another worker replaces it: that is how the two are told apart.
        The rows and the log bounds are read without the lock; what is done with
        them is decided under it, for partitions this worker still delivers then
        (a revoke may have come in between: such a partition is not placed again).
        """
        tps = list(tps)
        rows = self.store.rows(self.group, partitions=tps)
        mine = {tp: row for tp, row in rows.items() if row.owner == self.worker_id}
        bounds = self.source.log_bounds(list(mine)) if mine else {}
        times = self._policy_times(list(mine)) if mine else {}
        adopted: list[TP] = []
        with self.lock:
            others = [tp for tp in tps if tp not in mine and (tp in self.owned or tp in self.held)]
            seen = time.monotonic()
            for tp, row in mine.items():
                if (tp in self.owned or tp in self.held) and self._adopt(tp, row, bounds[tp], times.get(tp)):
                    adopted.append(tp)
            dropped = self.partitions.fence(others, seen)
        return adopted, dropped

    def _adopt(self, tp: TP, row: Row, bounds: tuple[int, int], policy_found: int | None) -> bool:
        """Follow the stored row of a partition this worker still owns. Lock held."""
        current = self.owned.get(tp)
        if current is not None and current.epoch == row.epoch and current.committed == row.next_offset:
            return False  # adopted already (by the periodic check or a fence in between)
        if current is not None and current.epoch == row.epoch:
            # Same epoch, another offset: only a commit this worker misjudged could do
            # that. The stored row is the truth: deliver from there.
            log.error("%s[%d]: stored offset %s differs from this worker's %d under the same epoch %d: "
                      "following the stored offset", tp[0], tp[1], row.next_offset, current.committed, row.epoch)
        else:
            log.info("%s[%d] was reset to %s by an operator (epoch %d): flushing and seeking", tp[0], tp[1],
                     row.next_offset, row.epoch)
        plan = self._plan(tp, Claim(row.next_offset, row.epoch), bounds, policy_found)
        if plan.offset is not None and plan.offset != plan.stored:
            # Reset below the log start (or to nothing): store where we start, under the row's epoch.
            try:
                plan = _Plan(self.store.reset(self.group, tp, plan.offset, expected_epoch=row.epoch,
                                              reason=plan.why or ""), plan.stored, plan.offset, plan.why, plan.lost)
            except FencedError:
                self.fence([tp])
                return False
        self._apply(tp, plan)
        return True

    def reclaim_orphans(self) -> list[TP]:
        """Partitions fenced a session timeout ago that Kafka still assigns here go back to pending.

        Re-claiming at once would let a zombie and this worker take a partition from
        each other in turn; after a session timeout a zombie has been evicted, and a
        partition Kafka still gives this worker would otherwise be consumed by nobody.
        """
        if not self.fenced_at:
            return []
        due = [tp for tp, at in self.fenced_at.items()
               if time.monotonic() - at > self.settings.session_timeout_ms / 1000]
        if not due:
            return []
        assigned = self.source.assignment()
        return self.partitions.reclaim(due, assigned)

    # -- explicit resets --------------------------------------------------------

    def reset(self, targets: Mapping[TP, Target], strict: bool, reason: str) -> dict[TP, int]:
        """Move held or owned partitions to targets, persisting each with an epoch bump. See Worker.reset_offsets."""
        with self.lock:
            epochs = {tp: o.epoch for tp, o in self.owned.items()} | dict(self.held)
            foreign = [tp for tp in targets if tp not in epochs]
            if foreign:
                raise KstoreError(f"this worker does not hold {fmt(foreign)}; move others with `kstore offsets set`")
            resolved = self._resolve(targets, strict)
            for tp, (offset, why) in resolved.items():
                note = reason if why is None else f"{reason}: {why}"
                epoch = self.store.reset(self.group, tp, offset, expected_epoch=epochs[tp], reason=note)
                self._apply(tp, _Plan(epoch, None, offset))
                log.info("reset %s[%d] to %d (%s)", tp[0], tp[1], offset, note)
        return {tp: offset for tp, (offset, _why) in resolved.items()}

    def _resolve(self, targets: Mapping[TP, Target], strict: bool) -> dict[TP, tuple[int, str | None]]:
        """Check targets against the logs; an invalid one gets the start policy (or raises, if strict).

        Returns ``{tp: (offset, why)}``, ``why`` None when the target was used as given.
        """
        bounds = self.source.log_bounds(list(targets))
        times = {tp: t for tp, t in targets.items() if isinstance(t, datetime)}
        found = self.source.offsets_for_times(times) if times else {}
        out: dict[TP, tuple[int, str | None]] = {}
        for tp, target in targets.items():
            offset, problem = check_target(target, bounds[tp], found.get(tp))
            if offset is not None:
                out[tp] = (offset, None)
                continue
            if strict:
                raise InvalidOffsetError(f"{tp[0]}[{tp[1]}]: {problem}")
            fallback = self._policy_offset(tp, bounds[tp])
            log.error("%s[%d]: %s; using start_from=%s (offset %d) instead", tp[0], tp[1], problem,
                      self.settings.start_from, fallback)
            out[tp] = (fallback, f"{problem}: start_from={self.settings.start_from}")
        return out

    # -- for the batch loop -------------------------------------------------------

    def positions(self, ends: Mapping[TP, int]) -> dict[TP, Position]:
        """What a batch ending at ``ends`` commits: ``(stored offset, new offset, epoch)`` per partition.

        Caller holds the lock (the batch is taken under it). The stored offset is the
        compare-and-set's expectation: the commit matches only if the row still has it.
        """
        owned = self.owned
        return {tp: Position((o := owned[tp]).committed, end, o.epoch) for tp, end in ends.items()}

    def committed(self, positions: Mapping[TP, Position]) -> None:
        """Note committed positions, for partitions still held at the batch's epoch and position."""
        with self.lock:
            for tp, (start, nxt, epoch) in positions.items():
                owned = self.owned.get(tp)
                if owned is not None and owned.epoch == epoch and owned.committed == start:
                    owned.committed = nxt

    def still_ours(self, tps: Iterable[TP], positions: Mapping[TP, Position]) -> list[TP]:
        """Of fenced partitions, those this worker has not itself moved since the batch began."""
        with self.lock:
            owned = self.owned
            return [tp for tp in tps if tp in owned and owned[tp].epoch == positions[tp].epoch
                    and owned[tp].committed == positions[tp].expected]

    def dropped(self, positions: Mapping[TP, Position]) -> set[TP]:
        """Of a batch's partitions, those this worker stopped delivering since it was taken
        (revoked, lost or fenced): the batch must not commit them, whether or not another worker
        has claimed them yet. Checked just before the batch's offsets are written."""
        with self.lock:
            owned = self.owned
            return {tp for tp in positions if tp not in owned}

    def offsets(self) -> dict[TP, int]:
        with self.lock:
            return {tp: o.committed for tp, o in self.owned.items()}
