"""What must hold, checked at delivery, after every action (the journal) and at the end.

Exactly-once with operator resets, as checked here:

- **At delivery** (inside the batch's transaction): the messages of each partition
  are contiguous, the partition was owned when the batch was taken, and if the
  stored row still carries the epoch the batch was taken under (the batch can
  still commit), the first message is the stored ``next_offset`` and the row's
  owner is this worker. A batch under an older epoch may be delivered (a zombie,
  or a reset not noticed yet): it cannot commit, and the journal would show it.
  So may, while ``late_read_back`` is relaxed, a batch starting below the stored
  offset, re-run by a worker one of whose lost COMMITs landed late: the
  compare-and-set's position check keeps it from committing.
- **Per committed transaction** (journal): every move of a partition's
  ``next_offset`` from ``a`` to ``b`` under an unchanged epoch (a commit), with
  effects or without, is made by the row's owner and carries exactly one effect or
  dead letter for each offset in ``[a, b)``; no effect or dead letter commits
  without such a move; a move under a new epoch (a reset) is an operator's, a
  ``Worker.reset_offsets`` the schedule made, or kstore placing a partition with no
  stored offset at the log start; a claim bumps the epoch, keeps the offset and names the claimer; epochs
  never go back. So the effects are exactly what the history of resets dictates:
  a reset backwards replays, a reset forwards skips, nothing else repeats or skips.
- **At the end** (after draining with faults off): every partition's stored offset
  is its log end; every message has as many effects (a poison message as many
  dead-letterings, a new letter or a failure added to its waiting one, and no effect)
  as commits moved its partition's offset past it, counted from the offsets' history
  alone (a reset backwards makes a second pass, a reset forwards skips); each was
  passed over at least once; without resets, exactly one; dead letters are only ever
  written for poison messages.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .db import JournalRow

TP = tuple[str, int]


class Violation(BaseException):
    """An invariant failed: the schedule stops here."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.message = message

    def __reduce__(self) -> tuple[type[Violation], tuple[str, str]]:  # picklable (parallel runs)
        return Violation, (self.kind, self.message)


@dataclass(frozen=True)
class StoredRow:
    next_offset: int | None
    epoch: int
    owner: str | None


@dataclass
class Delivery:
    """What the processor was handed, for one partition of one batch."""

    tp: TP
    offsets: list[int]
    values: list[bytes]


def check_delivery(worker_id: str, taken: dict[TP, int | None], rows: dict[TP, StoredRow],
                   delivery: Delivery, log_value: Any, journal: JournalCheck, stale_ok: bool = False) -> bool:
    """The delivery invariants for one partition of a batch (see the module docstring).

    ``stale_ok``: a batch starting below the stored offset under its epoch is let through
    (it cannot commit: the compare-and-set matches the position too). True if it was one.
    """
    tp, offsets = delivery.tp, delivery.offsets
    resets = journal.resets[tp]
    where = f"{tp[0]}[{tp[1]}] offsets {offsets[0]}..{offsets[-1]}"
    if offsets != list(range(offsets[0], offsets[0] + len(offsets))):
        raise Violation("delivery", f"{where}: not contiguous: {offsets}")
    for offset, value in zip(offsets, delivery.values, strict=True):
        if value != log_value(tp, offset):
            raise Violation("delivery", f"{where}: offset {offset} carries a value that is not the log's")
    epoch = taken.get(tp)
    if epoch is None:
        raise Violation("delivery", f"{where}: delivered although not owned (claimed) when the batch was taken")
    reset = journal.last_reset.get(tp)
    # Only at the reset's own epoch: a later epoch means a later claim or reset, which the
    # journal may not have seen yet (a reset_offsets nested inside this very turn); the row
    # check below holds such a batch to the offset stored at its epoch instead.
    if reset is not None and epoch == reset[0] and offsets[0] < reset[1]:
        raise Violation("delivery", f"{where} delivered at epoch {epoch}: a stale record after the reset to "
                                    f"{reset[1]} at epoch {reset[0]}\nresets of it so far: {', '.join(resets)}")
    row = rows.get(tp)
    if row is None or row.epoch != epoch:
        return False  # fenced: this batch cannot commit
    history = f"\nresets of it so far: {', '.join(resets) or 'none'}"
    if row.owner != worker_id:
        raise Violation("delivery", f"{where}: row at our epoch {epoch} names owner {row.owner}{history}")
    if offsets[0] != row.next_offset:
        stale = row.next_offset is not None and offsets[0] < row.next_offset
        if stale and stale_ok:
            return True
        what = "a stale or duplicate record" if stale else "a gap"
        raise Violation("delivery", f"{where} delivered at epoch {epoch} while {row.next_offset} is stored: "
                                    f"{what}{history}")
    return False


@dataclass
class _Txn:
    label: str
    rows: list[JournalRow] = field(default_factory=list)


class JournalCheck:
    """Checks each committed transaction of the journal (see the module docstring)."""

    def __init__(self, start_of: Callable[[TP], int], worker_id_of: Callable[[str], str | None]) -> None:
        self._start_of = start_of
        self._worker_id_of = worker_id_of
        self._open: list[JournalRow] = []
        #: (label, tp, offset) of Worker.reset_offsets calls in progress.
        self.expected_resets: list[tuple[str, TP, int]] = []
        #: Every committed transaction, for traces: (label, summary).
        self.history: list[str] = []
        self.resets: dict[TP, list[str]] = defaultdict(list)
        #: (epoch, offset) of each partition's latest reset: no batch taken under that epoch or a
        #: later one may hold a record below that offset (until the next reset).
        self.last_reset: dict[TP, tuple[int, int]] = {}
        #: How many commits moved each partition's offset over each offset (a reset backwards makes
        #: a second pass), and how many resets jumped forward over it: what the effects must match.
        self.passes: Counter[tuple[TP, int]] = Counter()
        self.skipped: Counter[tuple[TP, int]] = Counter()

    def feed(self, rows: Iterable[JournalRow]) -> None:
        for row in rows:
            if row.kind == "commit":
                self._check(_Txn(row.label or "?", self._open))
                self._open = []
            else:
                self._open.append(row)

    def finish_action(self) -> None:
        if self._open:
            raise Violation("journal", f"writes committed without a commit marker: {self._open[:3]}")

    def _check(self, txn: _Txn) -> None:
        moved: dict[TP, JournalRow] = {}
        items: dict[TP, list[int]] = defaultdict(list)
        for row in txn.rows:
            tp = (row.topic or "", row.partition_id or 0)
            if row.kind in ("effect", "dead"):
                assert row.new_next is not None
                items[tp].append(row.new_next)
                if row.kind == "effect" and row.label != txn.label:
                    raise Violation("journal", f"{txn.label} committed an effect written by {row.label}")
            elif row.kind == "insert" and txn.label == "operator":
                self._reset(txn.label, tp, row)  # a reset of a partition never claimed creates its row
            elif row.kind == "update" and self._is_commit(txn.label, tp, row):
                if tp in moved:
                    raise Violation("journal", f"{txn.label} moved {tp} twice in one transaction")
                moved[tp] = row
        # Every move, with effects or not: a commit that moves an offset without its effects is a loss.
        for tp in sorted(set(items) | set(moved)):
            self._check_items(txn.label, tp, sorted(items.get(tp, [])), moved.get(tp))
        self.history.append(f"{txn.label}: " + "; ".join(_summary(r) for r in txn.rows))

    def _is_commit(self, label: str, tp: TP, row: JournalRow) -> bool:
        """Check one update of an offsets row; True if it is a commit (offset moved, same epoch)."""
        assert row.old_epoch is not None and row.new_epoch is not None
        if row.new_epoch < row.old_epoch:
            raise Violation("journal", f"{label} moved {tp}'s epoch back: {row.old_epoch} -> {row.new_epoch}")
        if row.new_epoch > row.old_epoch:
            self._check_epoch_bump(label, tp, row)
            return False
        if row.old_next == row.new_next:
            return False
        if row.old_next is None:
            self._check_start(label, tp, row)
            return False
        if row.new_owner != self._worker_id_of(label):
            raise Violation("journal", f"{label} moved {tp} {row.old_next} -> {row.new_next} at epoch "
                                       f"{row.new_epoch}, which {row.new_owner} holds")
        return True

    def _check_epoch_bump(self, label: str, tp: TP, row: JournalRow) -> None:
        if label == "operator":
            self._reset(label, tp, row)
            return
        if row.old_next == row.new_next:
            if row.new_owner != self._worker_id_of(label):
                raise Violation("journal", f"{label} claimed {tp} in the name of {row.new_owner}")
            return
        if row.old_next is None:
            self._check_start(label, tp, row)
            return
        expected = (label, tp, row.new_next)
        if expected in self.expected_resets:
            self.expected_resets.remove(expected)
            self._reset(label, tp, row)
            return
        raise Violation("journal", f"{label} moved {tp} {row.old_next} -> {row.new_next} with a new epoch "
                                   f"{row.new_epoch}, and nobody asked for a reset")

    def _reset(self, label: str, tp: TP, row: JournalRow) -> None:
        assert row.new_epoch is not None and row.new_next is not None
        old = self._start_of(tp) if row.old_next is None else row.old_next  # no row yet: from the log start
        self.skipped.update((tp, o) for o in range(old, row.new_next))
        self.resets[tp].append(f"{label} {row.old_next}->{row.new_next} (epoch {row.new_epoch})")
        self.last_reset[tp] = (row.new_epoch, row.new_next)

    def _check_start(self, label: str, tp: TP, row: JournalRow) -> None:
        if row.new_next != self._start_of(tp):
            raise Violation("journal", f"{label} placed {tp} (no stored offset) at {row.new_next}, not at the log "
                                       f"start {self._start_of(tp)} (start_from=earliest)")

    def _check_items(self, label: str, tp: TP, offsets: list[int], move: JournalRow | None) -> None:
        if move is None:
            raise Violation("journal", f"{label} committed effects/dead letters for {tp} offsets {offsets} "
                                       "without moving its offset")
        assert move.old_next is not None and move.new_next is not None
        want = list(range(move.old_next, move.new_next))
        self.passes.update((tp, o) for o in want)
        if not offsets:
            raise Violation("journal", f"{label} moved {tp} {move.old_next} -> {move.new_next} with no effects or "
                                       "dead letters: those messages are lost")
        if offsets != want:
            dup = sorted(o for o, n in Counter(offsets).items() if n > 1)
            raise Violation("journal", f"{label} moved {tp} {move.old_next} -> {move.new_next} with effects for "
                                       f"{offsets}" + (f" (twice: {dup})" if dup else ""))


def _summary(row: JournalRow) -> str:
    tp = f"{row.topic}[{row.partition_id}]"
    if row.kind in ("effect", "dead"):
        return f"{row.kind} {tp}@{row.new_next}"
    if row.kind == "insert":
        return f"insert {tp} next={row.new_next} epoch={row.new_epoch}"
    return f"update {tp} {row.old_next}->{row.new_next} epoch {row.old_epoch}->{row.new_epoch}"


def check_final(ends: dict[TP, int], stored: dict[TP, int | None], effects: Counter[tuple[TP, int]],
                dead: Counter[tuple[TP, int]], poison: set[tuple[TP, int]], journal: JournalCheck,
                had_resets: bool) -> None:
    """The end state after draining (see the module docstring)."""
    behind = {tp: (stored.get(tp), end) for tp, end in ends.items() if stored.get(tp) != end}
    if behind:
        raise Violation("final", f"not caught up after draining\n(stored, log end) {behind}")
    wrong_dead = sorted(k for k in dead if k not in poison)
    if wrong_dead:
        raise Violation("final", f"good messages dead-lettered: {wrong_dead}")
    poison_effects = sorted(k for k in effects if k in poison)
    if poison_effects:
        raise Violation("final", f"poison messages with effects: {poison_effects}")
    for tp, end in sorted(ends.items()):
        for offset in range(end):
            key = (tp, offset)
            _check_count(key, dead[key] if key in poison else effects[key], key in poison, journal, had_resets)


def _check_count(key: tuple[TP, int], got: int, poison: bool, journal: JournalCheck, had_resets: bool) -> None:
    """One offset's effects (or dead letters): one per commit that moved past it, and without
    resets exactly one; with resets, it was passed over at least once (by a commit or a reset)."""
    passes, skipped = journal.passes[key], journal.skipped[key]
    want = passes if had_resets else 1
    what = "dead letters" if poison else "effects"
    where = f"{key[0][0]}[{key[0][1]}] offset {key[1]}"
    if got != want or passes + skipped == 0:
        resets = ", ".join(journal.resets[key[0]]) or "none"
        raise Violation("final", f"{where}: {got} {what}, want {want} (commits past it: {passes}, "
                                 f"resets over it: {skipped})\nresets of it: {resets}")
