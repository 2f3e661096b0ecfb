"""kstore's offsets table and the statements on it (kstore.db.store), on SQLite: a reset waits
for a worker's write instead of failing, and records the offset that write committed as its FROM.
Resets beside a live worker on PostgreSQL: tests/integration/claims_and_resets/test_resets_beside_a_live_worker.py."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator

import pytest

from kstore import Settings
from kstore.db.store import Store, make_engine
from tests.support.harness import stored_offsets


@pytest.fixture
def sqlite_store(sqlite_dsn: str) -> Iterator[Store]:
    settings = Settings(dsn=sqlite_dsn)
    engine = make_engine(settings)
    yield Store(engine, settings)
    engine.dispose()


def test_reset_on_sqlite_waits_for_a_workers_write_instead_of_failing(sqlite_dsn: str, sqlite_store: Store) -> None:
    sqlite_store.reset("g", ("t", 0), 10, expected_epoch=None, reason="setup")
    # A worker's batch: a write transaction open (BEGIN IMMEDIATE + its offset UPDATE) for a second.
    batch = sqlite3.connect(sqlite_dsn.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
    batch.execute("BEGIN IMMEDIATE")
    batch.execute("UPDATE kstore_offsets SET next_offset = 20 WHERE consumer_group = 'g'")
    commit = threading.Timer(1.0, batch.execute, ["COMMIT"])
    commit.start()
    started = time.monotonic()
    try:
        sqlite_store.reset("g", ("t", 0), 5, expected_epoch=None, reason="admin")
    finally:
        commit.join()
        batch.close()
    assert time.monotonic() - started >= 0.9, "it cannot have written while the batch held the lock"
    assert stored_offsets(sqlite_dsn, "g") == {("t", 0): 5}
    latest = sqlite_store.history_entries("g")[0]
    assert (latest.from_offset, latest.to_offset) == (20, 5), "FROM is what the batch committed"
