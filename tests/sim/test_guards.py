"""Each guard of exactly once, proven on its own, in scripted simulations (tests/sim/guards.py).

Two pairs of guards overlap: the offset commit's compare-and-set on the batch's start
(``position``) and the read back of a COMMIT whose answer was lost (``read_back``); the
commit's epoch fence (``epoch``) and the revoke check before it (``revoke``). Each test
switches off one guard of a pair and shows that the other alone keeps the scenario
exactly-once; a companion switches off both and shows the scenario then breaks it, so
none of these can pass for want of a scenario that reaches the guards.

Each scenario runs on a few seeds (the simulated consumer's fetch sizes and the group's
choices vary); each seed replays identically.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from kstore import Settings
from kstore.db.store import Store
from tests.sim.guards import Result, config, lost_answer_retried, play, switched_off, zombie
from tests.sim.world import Config, World

SEEDS = (0, 1, 2)
#: The lost answer's retry re-delivers a batch below the stored offset: the delivery check lets it
#: through (see tests/sim/invariants.py); the journal and the effects judge whether it commits.
LOST = config(slots=1, tolerate=frozenset({"late_read_back"}))
ZOMBIE = config(slots=2)
HEARS = partial(zombie, hears=True)
DEAF = partial(zombie, hears=False)


def _play(scenario: Callable[[World], None], cfg: Config, tmp_path: Path, seed: int, *off: str) -> Result:
    return play(scenario, cfg, tmp_path / "sim", frozenset(off), seed)


def _exactly_once(result: Result) -> None:
    assert result.violation is None and not result.duplicates, result.report()
    assert sorted(result.effects.values()) == [1, 1, 1], result.report()


def _rerun(result: Result) -> bool:
    """The batch whose COMMIT landed was handed to the processor again (the read back said it did not land)."""
    return result.fired["lost_answer/late: batch re-run below the stored offset"] > 0


# -- the compare-and-set's position check and the read back ---------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_the_position_check_alone_stops_a_landed_commit_from_landing_again(tmp_path: Path, seed: int) -> None:
    result = _play(lost_answer_retried, LOST, tmp_path, seed, "read_back")
    assert _rerun(result), "the batch was not run again: the position check was never needed\n" + result.report()
    _exactly_once(result)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_read_back_alone_stops_a_landed_commit_from_landing_again(tmp_path: Path, seed: int) -> None:
    result = _play(lost_answer_retried, LOST, tmp_path, seed, "position")
    assert not _rerun(result), "the read back let the batch run again\n" + result.report()
    assert any("but landed" in line for line in result.trace), result.report()
    _exactly_once(result)


@pytest.mark.parametrize("seed", SEEDS)
def test_without_position_check_and_read_back_a_lost_answer_lands_twice(tmp_path: Path, seed: int) -> None:
    result = _play(lost_answer_retried, LOST, tmp_path, seed, "position", "read_back")
    assert result.duplicates, "the scenario cannot fail: it proves nothing about either guard\n" + result.report()
    assert result.violation is not None and "without moving its offset" in result.violation.message


# -- the epoch fence and the revoke check ----------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_the_epoch_fence_alone_stops_a_zombie_that_heard_of_its_loss(tmp_path: Path, seed: int) -> None:
    _exactly_once(_play(HEARS, ZOMBIE, tmp_path, seed, "revoke"))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_revoke_check_alone_stops_a_zombie_that_heard_of_its_loss(tmp_path: Path, seed: int) -> None:
    _exactly_once(_play(HEARS, ZOMBIE, tmp_path, seed, "epoch"))


@pytest.mark.parametrize("seed", SEEDS)
def test_without_epoch_fence_and_revoke_check_a_zombie_that_heard_of_its_loss_commits(
    tmp_path: Path, seed: int,
) -> None:
    result = _play(HEARS, ZOMBIE, tmp_path, seed, "epoch", "revoke")
    assert result.zombie_wrote, "the scenario cannot fail: it proves nothing about either guard\n" + result.report()


@pytest.mark.parametrize("seed", SEEDS)
def test_the_epoch_fence_stops_a_zombie_that_never_heard_of_its_loss(tmp_path: Path, seed: int) -> None:
    _exactly_once(_play(DEAF, ZOMBIE, tmp_path, seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_revoke_check_cannot_stop_a_zombie_that_never_heard_of_its_loss(tmp_path: Path, seed: int) -> None:
    """Only the database knows that another worker claimed the partition: without the epoch fence
    the zombie commits, revoke check or not."""
    result = _play(DEAF, ZOMBIE, tmp_path, seed, "epoch")
    assert result.zombie_wrote, result.report()


# -- every scenario, every guard on ----------------------------------------------------------------

@pytest.mark.parametrize("scenario", ["lost_answer", "zombie_hears", "zombie_deaf"])
def test_with_every_guard_on_each_scenario_is_exactly_once(tmp_path: Path, scenario: str) -> None:
    scenarios: dict[str, tuple[Callable[[World], None], Config]] = {
        "lost_answer": (lost_answer_retried, LOST), "zombie_hears": (HEARS, ZOMBIE), "zombie_deaf": (DEAF, ZOMBIE)}
    fn, cfg = scenarios[scenario]
    _exactly_once(_play(fn, cfg, tmp_path, 0))


# -- the switches ------------------------------------------------------------------------------------

@pytest.mark.parametrize("guard, term", [("position", "next_offset = :s0"), ("epoch", "epoch = :e0")])
def test_a_guard_switched_off_loses_its_term_of_the_offset_commit_and_only_it(guard: str, term: str) -> None:
    """The offset commit holds both terms; switching one guard off cuts that term, on both the
    plain statement and PostgreSQL's one-round-trip form."""
    for dsn in ("sqlite://", "postgresql+psycopg2://kstore@localhost/kstore"):  # no connection is made
        store = Store(create_engine(dsn), Settings(dsn=dsn))
        for commit in (False, True):
            assert term in store._commit_statement(1, commit=commit).text
            with switched_off(frozenset({guard})):
                sql = store._commit_statement(1, commit=commit).text
            other = "epoch = :e0" if guard == "position" else "next_offset = :s0"
            assert term not in sql and other in sql, sql


def test_a_guard_scenario_replays_identically(tmp_path: Path) -> None:
    """The same seed and guards give the same run: the same turns and the same commits."""
    first, again = (_play(HEARS, ZOMBIE, tmp_path, 1, "epoch", "revoke") for _ in range(2))
    assert _without_ids(first.trace) == _without_ids(again.trace)
    assert _without_ids(first.history) == _without_ids(again.history) and first.effects == again.effects


def _without_ids(lines: list[str]) -> list[str]:
    """Worker ids end in a random uuid: the only thing that differs between two runs."""
    return [re.sub(r"kstore-[^ ]+-[0-9]+-[0-9a-f]{8}", "ID", line) for line in lines]
