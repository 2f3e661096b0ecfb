"""Where the consumer's position moved, or could not go, by itself: kstore follows it loudly.

Two cases, both handled on the worker's main thread between batches, for partitions the
:class:`~kstore.engine.ownership.Ledger` owns:

- **Nothing to deliver** (:func:`advance`): kafka-python moves past transaction markers
  and records of aborted transactions without returning anything. The stored offset is
  moved there too, or a log ending in a marker would show a lag of 1 for good.
- **Out of the log** (:func:`relocate`): kstore's consumer has no reset policy
  (``auto_offset_reset="none"``), so a position that left the log (retention or
  ``delete-records`` moved the log start past it; a truncation) stops the partition
  instead of being reset silently. The partition is placed again as at claim time: below
  the log start it starts at ``start_from``, past the end (or truncated) it is held, and
  each is one ERROR line, a row in the reset history, and a count in
  ``kstore_position_resets_total``. The stored offset moves with an epoch bump, like any
  reset, so the store and the consumer never disagree.
"""

from __future__ import annotations

import logging

from kstore.db.writes import WRITES
from kstore.errors import FencedError
from kstore.targets import policy_offset
from kstore.types import Position
from kstore.types import TopicPartition as TP

from .ownership import Ledger, _Plan

log = logging.getLogger("kstore.engine.worker")

#: The ``reason`` label of ``kstore_position_resets_total``.
BELOW_LOG_START, PAST_LOG_END, TRUNCATED = "below_log_start", "past_log_end", "truncated"
RESET_REASONS = (BELOW_LOG_START, PAST_LOG_END, TRUNCATED)


def advance(ledger: Ledger) -> list[TP]:
    """Move stored offsets over what the consumer skipped with nothing to deliver, for owned
    partitions with nothing queued.

    One compare-and-set like a batch's (epoch and stored offset), with no effects, so rows
    that match commit even if others did not. A row that did not match is read back: at
    the new offset under this epoch, an earlier advance whose answer was lost landed;
    otherwise it is returned, for :meth:`Ledger.recheck`. Raises SQLAlchemyError if the
    database fails: nothing is noted, and the next call settles it the same way.
    """
    partitions, store = ledger.partitions, ledger.store
    with ledger.lock:
        committed = {tp: o.committed for tp, o in ledger.owned.items()}
        positions: dict[TP, Position] = {tp: Position(committed[tp], end, ledger.owned[tp].epoch)
                                         for tp, end in partitions.skipped(committed).items()}
    if not positions:
        return []
    with store.engine.connect() as conn, conn.execution_options(**WRITES).begin():
        unmatched = store.commit_offsets(conn, ledger.group, positions)
    moved: list[TP] = []
    if unmatched:
        rows = store.rows(ledger.group, partitions=unmatched)
        moved = sorted(tp for tp in unmatched if tp not in rows
                       or (rows[tp].epoch, rows[tp].next_offset) != (positions[tp].epoch, positions[tp].next))
        positions = {tp: pos for tp, pos in positions.items() if tp not in moved}
    ledger.committed(positions)
    log.debug("moved past transaction markers: %s", ", ".join(
        f"{t}[{p}] {start}->{end}" for (t, p), (start, end, _) in sorted(positions.items())))
    return moved


def relocate(ledger: Ledger) -> list[tuple[TP, str]]:
    """Place again the owned partitions kafka-python could not fetch from; returns each one
    moved or held, with its reason.

    A partition waits until everything fetched before its position was committed (its
    queue is empty and its stored offset is that position): the records kstore already
    holds are processed, and what was lost is exactly what lies between that position and
    the log start. Raises SQLAlchemyError, BrokerError or CommitInDoubtError (retried).
    """
    partitions = ledger.partitions
    with ledger.lock:
        found = {tp: seen for tp, seen in partitions.unfetchable().items()
                 if tp in ledger.owned and not partitions.has_records(tp) and ledger.owned[tp].committed == seen[0]}
    if not found:
        return []
    bounds = ledger.source.log_bounds(list(found))
    times = ledger._policy_times(list(found))
    done: list[tuple[TP, str]] = []
    with ledger.lock:
        for tp, (offset, truncated) in found.items():
            owned = ledger.owned.get(tp)
            if owned is None or owned.committed != offset or partitions.unfetchable().get(tp) != (offset, truncated):
                continue  # revoked, fenced or placed meanwhile
            reason = _place(ledger, tp, owned.epoch, offset, truncated, bounds[tp], times.get(tp))
            if reason is not None:
                done.append((tp, reason))
    return done


def _place(ledger: Ledger, tp: TP, epoch: int, offset: int, truncated: str | None,
           bounds: tuple[int, int], policy_found: int | None) -> str | None:
    """One partition out of the log, as :meth:`Ledger._plan` places a claimed one. Lock held."""
    start, end = bounds
    if truncated is None and start <= offset <= end:
        log.warning("%s[%d]: offset %d was out of range, but the log holds it now (%d..%d): fetching it again",
                    tp[0], tp[1], offset, start, end)
        ledger.partitions.place(tp, offset)
        return None
    if truncated is not None or offset > end:
        what = truncated or f"offset {offset} is past the log end {end}"
        why = (f"{what}: partition held at {offset}, nothing consumed until `kstore offsets set --group "
               f"{ledger.group} --topic {tp[0]} --partition {tp[1]} ... --execute`")
        ledger.store.note(ledger.group, tp, offset, epoch, why)
        ledger._apply(tp, _Plan(epoch, offset, None, why))  # logs the ERROR line
        return TRUNCATED if truncated is not None else PAST_LOG_END
    target = policy_offset(ledger.policy, bounds, policy_found)
    why = (f"offset {offset} is out of range: the log now starts at {start} (retention or delete-records); "
           f"MESSAGES {offset}..{start - 1} WERE NEVER PROCESSED ({start - offset} skipped): "
           f"start_from={ledger.settings.start_from}")
    try:
        new_epoch = ledger.store.reset(ledger.group, tp, target, expected_epoch=epoch, reason=why)
    except FencedError:  # another owner claimed it meanwhile: theirs now
        ledger.fence([tp])
        return None
    log.error("%s[%d]: %s; continuing at %d", tp[0], tp[1], why, target)
    ledger._apply(tp, _Plan(new_epoch, offset, target))
    return BELOW_LOG_START
