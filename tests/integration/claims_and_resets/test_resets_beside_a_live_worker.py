"""Resets against a live pipeline on PostgreSQL: deciding under the row's lock. Waiting for a worker's
write on SQLite: tests/unit/db/test_store.py."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from kstore import InvalidOffsetError, Settings
from kstore.db.store import Store
from kstore.ops.offsets import set_offsets
from tests.support.harness import stored_offsets

READ_ROWS = Store.rows


def advance_after_reading(monkeypatch: pytest.MonkeyPatch, dsn: str, group: str, to: dict[int, int]) -> None:
    """Right after set_offsets reads the stored rows, a worker commits: the rows it planned from are stale."""

    def rows_then_a_worker_commits(self: Store, *args: Any, **kwargs: Any) -> Any:
        found = READ_ROWS(self, *args, **kwargs)
        engine = sa.create_engine(dsn)
        with engine.begin() as conn:
            for partition, offset in to.items():
                conn.execute(sa.text("UPDATE kstore_offsets SET next_offset = :o, epoch = epoch + 1 "
                                     "WHERE consumer_group = :g AND partition_id = :p"),
                             {"o": offset, "g": group, "p": partition})
        engine.dispose()
        return found

    monkeypatch.setattr(Store, "rows", rows_then_a_worker_commits)


def test_shift_by_is_relative_to_the_offset_stored_when_it_is_written(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    topic = new_topic(partitions=2)
    for p in (0, 1):
        produce(topic, (f"v{i}" for i in range(100)), partition=p)
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka)
    set_offsets(settings, "live", topic, to_offset=40, execute=True, reason="test")

    advance_after_reading(monkeypatch, pg_dsn, "live", {0: 60, 1: 60})
    plan = set_offsets(settings, "live", topic, shift_by=-10, execute=True, reason="test")
    assert stored_offsets(pg_dsn, "live") == {(topic, 0): 50, (topic, 1): 50}, "shifted from 60, not from 40"
    assert [(p.partition, p.from_offset, p.to_offset) for p in plan] == [(0, 60, 50), (1, 60, 50)]

    # Valid when planned (50 + 45 = 95), past the log end when written (90 + 45): refused, nothing changed,
    # not even on partition 1, which was still in range.
    advance_after_reading(monkeypatch, pg_dsn, "live", {0: 90})
    with pytest.raises(InvalidOffsetError, match=r"past the log end 100.*nothing changed"):
        set_offsets(settings, "live", topic, shift_by=45, execute=True, reason="test")
    assert stored_offsets(pg_dsn, "live") == {(topic, 0): 90, (topic, 1): 50}

    advance_after_reading(monkeypatch, pg_dsn, "live", {0: 95})
    plan = set_offsets(settings, "live", topic, shift_by=10, clamp=True, execute=True, reason="test")
    assert [(p.partition, p.from_offset, p.to_offset, p.note[:7]) for p in plan] == [
        (0, 95, 100, "clamped"), (1, 50, 60, "")]
    assert stored_offsets(pg_dsn, "live") == {(topic, 0): 100, (topic, 1): 60}
