"""Every outbox's backlog in one statement, on PostgreSQL: records waiting and the oldest's write time
per outbox, a group's and an application's alike; and on an outbox of 200,000 rows waiting the
statement reads the rows only by their primary key, never scanning them."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.store import make_engine
from kstore.relay.tables import Backlog, backlogs, build_tables
from tests.support.outbox_backlogs import EXPECTED, group_outbox, rows_waiting, seed

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(pg_dsn: str) -> Any:
    found = make_engine(Settings(dsn=pg_dsn))
    yield found
    found.dispose()


def test_every_outbox_has_its_records_waiting_and_oldest_write_drained_ones_none(
        engine: sa.Engine, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(engine, pg_dsn, monkeypatch)
    with engine.connect() as conn:
        found = backlogs(conn, build_tables())
        assert backlogs(conn, build_tables(), "payments") == [Backlog(*EXPECTED[2])]
    assert found == [Backlog(*expected) for expected in EXPECTED]
    assert {b.name: b.waiting for b in found if b.waiting} == rows_waiting(engine), "the count is the rows'"


def test_a_large_outbox_is_read_by_its_primary_key_not_scanned(engine: sa.Engine) -> None:
    big = group_outbox(engine, "big", shards=4)
    rows = 200_000
    t = build_tables()
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO kstore_outbox (consumer_group, shard, seq, topic, value, created_at) "
            "SELECT 'big', n % 4, n / 4 + 1, 't', 'v', now() - make_interval(secs => :rows - n) "
            "FROM generate_series(0, :rows - 1) AS n"), {"rows": rows})
        conn.execute(t.shards.update().where(t.shards.c.consumer_group == "big")
                     .values(next_seq=rows // 4 + 1))
        conn.execute(sa.text("ANALYZE kstore_outbox"))
    statements: list[tuple[str, Any]] = []

    def seen(*args: Any) -> None:
        statements.append((args[2], args[3]))

    sa.event.listen(engine, "before_cursor_execute", seen)
    with engine.connect() as conn:
        (found,) = backlogs(conn, build_tables())
    sa.event.remove(engine, "before_cursor_execute", seen)
    assert (found.name, found.waiting) == ("big", rows) and found.oldest is not None
    assert big.backlog()[0] == rows
    (statement, params), = statements
    with engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {statement}", params))
    assert "Index" in plan and "kstore_outbox_pkey" in plan, plan
    assert not re.search(r"Seq Scan on kstore_outbox(?!\w)", plan), plan
