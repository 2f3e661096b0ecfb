"""Scripted schedules that reach each guard of exactly once, with any of the guards switched off.

A batch commit is kept from landing twice, or from landing for a worker that lost its
partition, by two pairs of guards that overlap:

- ``position`` (the offset commit's compare-and-set matches the batch's start,
  ``AND next_offset = <start>``) and ``read_back`` (after a COMMIT whose answer was lost,
  the rows are read back and a batch that landed is not run again);
- ``epoch`` (the offset commit matches the epoch the worker claimed,
  ``AND epoch = <claimed>``) and ``revoke`` (just before the commit, a batch with a
  partition the worker stopped owning while it ran is rolled back).

Random schedules reach a guard only where its partner has already stopped the harm, so
they cannot tell whether either works. Each scenario here is built, not drawn: a lost
answer to a COMMIT that landed, and a zombie paused between taking its batch and
committing it. :func:`play` runs one with the guards :data:`GUARDS` names switched off
(by patching kstore's functions for the run: nothing in kstore can turn a guard off)
and returns what landed: the simulation's invariants, and each offset's effects.

Each run is deterministic: the world's own choices come from ``seed``, and nothing is
preempted (``preempt=0``): the scenario's interleaving is all in its script.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from sqlalchemy import DateTime, bindparam, text
from sqlalchemy.sql.elements import TextClause

import kstore.engine.commit
from kstore.db.store import Store
from kstore.engine.batches import Batches
from kstore.engine.ownership import Ledger

from . import db as simdb
from .db import template
from .invariants import Violation
from .schedule import _no_collector, apply, patched_kstore
from .world import Config, Member, World

TP = tuple[str, int]
#: The guards a scenario can switch off (see the module docstring).
GUARDS = ("position", "read_back", "epoch", "revoke")
#: The one partition every scenario runs on.
PARTITION: TP = ("t", 0)
#: What the processor of a scenario reads: enough for a batch of a few messages.
MESSAGES = 3

#: The offset commit's predicates, by guard: (column, parameter prefix).
_PREDICATES = {"position": ("next_offset", "s"), "epoch": ("epoch", "e")}


@dataclass
class Result:
    """What a scenario left behind."""

    violation: Violation | None
    #: Effects committed, per (partition, offset).
    effects: Counter[tuple[TP, int]]
    #: The world's trace (turns, kstore's log lines) and committed transactions, for a failure's message.
    trace: list[str]
    history: list[str]
    fired: Counter[str]

    @property
    def duplicates(self) -> list[tuple[TP, int]]:
        """Offsets whose effects were committed more than once."""
        return sorted(key for key, n in self.effects.items() if n > 1)

    @property
    def zombie_wrote(self) -> bool:
        """A worker committed an offset move on a row another worker had claimed."""
        return (self.violation is not None and self.violation.kind == "journal"
                and re.search(r"moved .* at epoch [0-9]+, which .* holds", self.violation.message) is not None)

    def report(self) -> str:
        return "\n".join([f"violation: {self.violation}", f"effects: {dict(sorted(self.effects.items()))}",
                          f"faults fired: {dict(self.fired)}", "trace:", *("  " + t for t in self.trace[-80:]),
                          "committed:", *("  " + h for h in self.history)])


# -- switching guards off ------------------------------------------------------------------

@contextmanager
def switched_off(guards: frozenset[str]) -> Iterator[None]:
    """kstore with the named guards switched off, for the duration of the block."""
    unknown = guards - set(GUARDS)
    assert not unknown, f"no such guard: {sorted(unknown)}"
    with ExitStack() as stack:
        predicates = [_PREDICATES[g] for g in GUARDS if g in guards and g in _PREDICATES]
        if predicates:
            stack.enter_context(mock.patch.object(Store, "_commit_statement", _without(predicates)))
        if "read_back" in guards:
            stack.enter_context(mock.patch.object(kstore.engine.commit, "_outcome", _never_landed()))
        if "revoke" in guards:
            stack.enter_context(mock.patch.object(Ledger, "dropped", lambda _self, _positions: set()))
        yield


def _without(predicates: list[tuple[str, str]]) -> Callable[..., TextClause]:
    """``Store._commit_statement`` with the offset commit's ``AND <column> = :<prefix><i>`` terms cut out."""
    original = Store._commit_statement

    def commit_statement(self: Store, n: int, *, commit: bool) -> TextClause:
        sql = original(self, n, commit=commit).text
        quote = self.engine.dialect.identifier_preparer.quote
        for column, prefix in predicates:
            # Tolerant: if the term is already gone (a mutant of the real code), there is nothing to cut.
            sql = re.sub(rf" AND {re.escape(quote(column))} = :{prefix}[0-9]+\b", "", sql)
        return text(sql).bindparams(bindparam("u", type_=DateTime(timezone=True)))

    return commit_statement


def _never_landed() -> Callable[..., tuple[bool, set[TP]]]:
    """The read back of a commit in doubt answering "did not land" whatever the rows hold
    (rows another owner moved are still reported as such)."""
    original = kstore.engine.commit._outcome

    def outcome(positions: Any, rows: Any) -> tuple[bool, set[TP]]:
        _landed, moved = original(positions, rows)
        return False, moved

    return outcome


# -- the scenarios ---------------------------------------------------------------------------

def config(slots: int, tolerate: frozenset[str] = frozenset()) -> Config:
    """One partition, batches of up to ``MESSAGES``, no preemption, no poison, no random faults."""
    return Config(partitions={PARTITION[0]: 1}, slots=slots, max_batch_size=MESSAGES, max_poll_records=MESSAGES,
                  max_buffered_bytes=32 * 2**20, preempt=0.0, resets=False, faults=frozenset(),
                  tolerate=tolerate, steady=False)


def lost_answer_retried(world: World) -> None:
    """w0's first batch commits, but the answer to its COMMIT is lost (the connection is cut after
    the server committed). Whatever w0 concludes, the schedule then drains: a batch run again after
    it landed commits its effects a second time unless a guard stops it."""
    _start_with_records(world, slots=[0])
    world.act("arm w0 lost_answer (the COMMIT lands)", lambda: world.arm(0, "lost_answer"))
    # The re-run of a batch below the stored offset is the retry under test: the delivery check lets it
    # through (as it does for a late COMMIT's), and the journal judges whether it commits.
    world.db.landed_late.add("w0")
    apply(world, ("step", 0))
    assert world.db.fired["lost_answer/landed"] == 1, "the scenario's COMMIT did not lose its answer"
    # Until w0 is done with the batch (it may be retried after a backoff): the drain alone would stop
    # at once, the stored offset being at the log's end already.
    w0 = world.members["w0"]
    for _ in range(40):
        if w0.batches.in_doubt is None and not _queued(world, 0):
            return
        world.round()
    raise AssertionError("w0 never settled the batch whose answer was lost")


def zombie(world: World, *, hears: bool) -> None:
    """w0 takes a batch, then stops (a long GC pause, say) before committing it: the group expels
    it, w1 joins and claims the partition at the same offset. Then w0 goes on with its batch.

    ``hears``: before w0 commits, its consumer has learned that it lost the partition (its fetch
    thread ran while the main thread was stopped): the revoke check can see it. Otherwise only the
    epoch in the database tells."""
    _start_with_records(world, slots=[0])
    zombie_member = world.members["w0"]

    def interlude() -> None:
        world.trace.append("  -- w0 stops after taking its batch; the group expels it; w1 claims")
        world.clock.advance(zombie_member.worker.settings.session_timeout_ms / 1000)
        assert zombie_member.consumer is not None
        world.group.expel(zombie_member.consumer)
        new = world.spawn(1)
        assert new is not None, "w1 did not start"
        for _ in range(3):  # join the group, then claim; no batch yet: the row stays at w0's start
            world.fetch_turn(new)
            world.step_turn(new)
            if _owner(world) == new.worker.worker_id:
                break
        assert _owner(world) == new.worker.worker_id, f"w1 did not claim {PARTITION}"
        if hears:
            world.trace.append("  -- w0's fetch thread learns it was expelled")
            zombie_member.consumer.io_step()  # its heartbeat finds the group moved on: on_partitions_lost
            world.fetch_turn(zombie_member)  # applies it: the partition leaves w0's ledger
            assert PARTITION not in zombie_member.ledger.owned, "w0 did not learn that it lost the partition"

    with _after_take(zombie_member, interlude) as ran:
        apply(world, ("step", 0))
    assert ran, "w0 took no batch"


def _start_with_records(world: World, slots: list[int]) -> None:
    """The workers in ``slots`` join, claim and have the partition's first records queued."""
    for slot in slots:
        apply(world, ("join", slot))
    apply(world, ("produce", 0, MESSAGES, False))
    for _ in range(3):  # join the group, claim, fetch: stop before a batch is taken
        for slot in slots:
            apply(world, ("fetch", slot))
            if not _queued(world, slot):
                apply(world, ("step", slot))
    assert all(_queued(world, slot) for slot in slots), "no records queued for the scenario's batch"


def _owner(world: World) -> str | None:
    rows = world.db.query("SELECT owner FROM kstore_offsets WHERE topic = ? AND partition_id = ?", PARTITION)
    return rows[0][0] if rows else None


def _queued(world: World, slot: int) -> bool:
    m = world.slots[slot]
    return m is not None and m.partitions is not None and m.partitions.queued() > 0


@contextmanager
def _after_take(member: Member, interlude: Callable[[], None]) -> Iterator[list[bool]]:
    """Run ``interlude`` once, right after ``member``'s worker takes its next batch (before its
    transaction begins: a transaction open on SQLite would lock out the other workers)."""
    original = Batches._take
    ran: list[bool] = []

    def take(self: Batches, size: int) -> Any:
        taken = original(self, size)
        if taken is not None and not ran and self is member.batches:
            ran.append(True)
            interlude()
        return taken

    with mock.patch.object(Batches, "_take", take):
        yield ran


def play(scenario: Callable[[World], None], cfg: Config, directory: Path, off: frozenset[str] = frozenset(),
         seed: int = 0) -> Result:
    """Run ``scenario`` then drain (faults off, every worker catching up), with the guards ``off``
    switched off, and report what landed. A violation stops the run where it happened."""
    directory.mkdir(parents=True, exist_ok=True)
    with _no_collector(), mock.patch.object(simdb, "LOST_ANSWER_OUTCOMES", {"landed": 1}):
        world = World(seed, cfg, template(directory), directory)
        violation: Violation | None = None
        try:
            with patched_kstore(world), switched_off(off):
                try:
                    scenario(world)
                    world.drain()
                except Violation as exc:
                    violation = exc
            effects: Counter[tuple[TP, int]] = Counter(
                ((t, p), o) for t, p, o in world.db.query("SELECT topic, partition_id, kafka_offset FROM sim_effects"))
        finally:
            world.close()
    world.db.remove()
    return Result(violation, effects, world.trace, world.journal.history, Counter(world.db.fired))
