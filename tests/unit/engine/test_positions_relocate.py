"""How the worker places a partition whose position left the log (kstore.engine.positions.relocate),
decided against a real store (SQLite) and a stand-in for the Kafka side: moved to start_from
below the log start, held past the end or after a truncation, fetched again when the log holds
the offset after all, and left alone until what was fetched before it is committed. The
broker-level path (a real out-of-range fetch) is in test_position_resets.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.store import Store, make_engine
from kstore.engine.ownership import Ledger
from kstore.engine.partitions import Owned, Partitions
from kstore.engine.positions import relocate
from kstore.kafka.seam import Fetched, Refused

TP = ("t", 0)
GROUP = "g"


class Source:
    """The parts of a ConsumerSource that relocate() uses; records what was done to the partition."""

    def __init__(self, bounds: tuple[int, int], unfetchable: dict[Any, tuple[int, str | None]]) -> None:
        self.bounds = bounds
        self.unfetchable = dict(unfetchable)
        self.placed: dict[Any, int] = {}
        self.paused: set[Any] = set()

    @staticmethod
    def size_of(records: Any) -> int:
        return 0

    def log_bounds(self, tps: list[Any]) -> dict[Any, tuple[int, int]]:
        return {tp: self.bounds for tp in tps}

    def seek(self, tp: Any, offset: int) -> None:
        self.placed[tp] = offset

    def resume(self, tps: list[Any]) -> None:
        self.paused.difference_update(tps)

    def pause(self, tps: list[Any]) -> None:
        self.paused.update(tps)

    release = pause

    def positions(self, tps: list[Any]) -> dict[Any, int]:
        return {}


def ledger_at(dsn: str, source: Source, committed: int) -> tuple[Ledger, int]:
    """A ledger owning TP at ``committed``, claimed in the store (returns its epoch)."""
    settings = Settings(dsn=dsn)
    store = Store(make_engine(settings), settings)
    with store.claiming(GROUP, [TP], "me") as (conn, claims):
        epoch = claims[TP].epoch
        store.start_at(conn, GROUP, TP, committed, epoch, "test start", None)
    partitions = Partitions(settings, source)  # type: ignore[arg-type]
    ledger = Ledger(settings, GROUP, "me", store, source, partitions)  # type: ignore[arg-type]
    ((offset, truncated),) = source.unfetchable.values()
    partitions.assign([TP])
    # Delivered from the offset the client then cannot fetch, its stored offset ``committed``.
    partitions.own(TP, Owned(epoch, committed), offset)
    partitions.queue_fetched(partitions.generations(), Fetched([], [Refused(TP, offset, truncated)]))
    assert partitions.unfetchable() == source.unfetchable
    source.placed.clear()
    return ledger, epoch


def row(dsn: str) -> tuple[int, int]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT next_offset, epoch FROM kstore_offsets")).one()
    engine.dispose()
    return int(found[0]), int(found[1])


def reasons(dsn: str) -> list[str]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        found = [r[0] for r in conn.execute(sa.text("SELECT reason FROM kstore_offset_history ORDER BY id"))]
    engine.dispose()
    return found[1:]  # after the test's own start


def test_below_the_log_start_moves_to_start_from_with_an_epoch_bump(sqlite_dsn: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    source = Source((150, 200), {TP: (100, None)})
    ledger, epoch = ledger_at(sqlite_dsn, source, 100)
    with caplog.at_level(logging.WARNING):
        assert relocate(ledger) == [(TP, "below_log_start")]
    assert source.placed == {TP: 150} and row(sqlite_dsn) == (150, epoch + 1)
    assert ledger.owned[TP] == Owned(epoch + 1, 150)
    (said,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.levelname == "ERROR" and "t[0]: offset 100 is out of range: the log now starts at 150" in said.message
    assert "MESSAGES 100..149 WERE NEVER PROCESSED (50 skipped)" in said.message
    assert len(reasons(sqlite_dsn)) == 1 and "out of range" in reasons(sqlite_dsn)[0]


@pytest.mark.parametrize(("bounds", "truncated", "reason", "said"), [
    ((0, 50), None, "past_log_end", "offset 100 is past the log end 50"),
    ((0, 200), "the log was truncated below this worker's position", "truncated", "truncated"),
])
def test_past_the_end_or_truncated_is_held_for_an_operator(sqlite_dsn: str, bounds: tuple[int, int],
                                                          truncated: str | None, reason: str, said: str) -> None:
    source = Source(bounds, {TP: (100, truncated)})
    ledger, epoch = ledger_at(sqlite_dsn, source, 100)
    assert relocate(ledger) == [(TP, reason)]
    assert TP in ledger.held and TP not in ledger.owned and TP in source.paused and not source.placed
    assert row(sqlite_dsn) == (100, epoch)  # nothing moved: an operator decides
    (noted,) = reasons(sqlite_dsn)
    assert said in noted and "kstore offsets set --group g --topic t --partition 0" in noted


def test_an_offset_the_log_holds_again_is_fetched_again(sqlite_dsn: str) -> None:
    source = Source((0, 200), {TP: (100, None)})
    ledger, epoch = ledger_at(sqlite_dsn, source, 100)
    assert relocate(ledger) == []
    assert source.placed == {TP: 100} and row(sqlite_dsn) == (100, epoch) and reasons(sqlite_dsn) == []


def test_nothing_moves_before_what_was_fetched_is_committed(sqlite_dsn: str) -> None:
    """The stored offset is behind the offset that could not be fetched: records before it are
    still to be committed, so the partition waits (then only what lies past it was lost)."""
    source = Source((150, 200), {TP: (100, None)})
    ledger, epoch = ledger_at(sqlite_dsn, source, 90)
    assert relocate(ledger) == []
    assert not source.placed and row(sqlite_dsn) == (90, epoch) and ledger.partitions.unfetchable() == {TP: (100, None)}
