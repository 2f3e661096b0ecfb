"""Every outbox's backlog in one statement, on SQLite: records waiting and the oldest's write time per
outbox, a group's and an application's alike, agreeing with the rows themselves; and a relay's gauges
of it, read at a scrape at most once every few seconds."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kstore import Settings, migrate
from kstore.db.store import make_engine
from kstore.relay.store import Outbox
from kstore.relay.tables import Backlog, backlogs, build_tables
from kstore.telemetry.metrics import Metrics
from tests.support.outbox_backlogs import EXPECTED, T0, rows_waiting, seed


@pytest.fixture
def dsn(tmp_path: Path) -> str:
    found = f"sqlite:///{tmp_path / 'outboxes.db'}"
    migrate(Settings(dsn=found))
    return found


def test_every_outbox_has_its_records_waiting_and_oldest_write_drained_ones_none(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(Settings(dsn=dsn))
    seed(engine, dsn, monkeypatch)
    with engine.connect() as conn:
        found = backlogs(conn, build_tables())
        assert backlogs(conn, build_tables(), "shop-web") == [Backlog(*EXPECTED[3])]
        assert backlogs(conn, build_tables(), "nowhere") == []
    assert found == [Backlog(*expected) for expected in EXPECTED]
    assert {b.name: b.waiting for b in found if b.waiting} == rows_waiting(engine), "the count is the rows'"
    assert found[3].age_s(T0 + timedelta(seconds=32.5)) == 12.5
    assert found[0].age_s(T0) == 0.0
    engine.dispose()


def test_one_statement_reads_every_outbox(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(Settings(dsn=dsn))
    seed(engine, dsn, monkeypatch)
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with engine.connect() as conn:
        assert len(backlogs(conn, build_tables())) == 4
    assert len([s for s in statements if s != "BEGIN"]) == 1, statements
    engine.dispose()


def test_an_outboxs_own_backlog_is_zero_before_it_has_shards(dsn: str) -> None:
    engine = make_engine(Settings(dsn=dsn))
    assert Outbox(engine, "not-yet").waiting() == Backlog("not-yet", 0, None)
    assert Outbox(engine, "not-yet").backlog() == (0, None)
    engine.dispose()


def gauges(metrics: Metrics) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, s.labels.get("outbox", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("kstore_outbox_")
            and s.name.endswith(("records_waiting", "oldest_record_age_seconds"))}


def test_a_relays_gauges_are_read_at_most_once_every_few_seconds_and_left_out_while_the_read_fails() -> None:
    reads: list[int] = []
    answers: list[Backlog | Exception] = [Backlog("shop", 4, T0), RuntimeError("database away"),
                                          Backlog("shop", 0, None)]

    def read() -> Backlog:
        reads.append(1)
        answer = answers[min(len(reads), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    cached = Metrics("shop")
    cached.watch_outbox(read, every_s=3600)
    for _ in range(3):
        assert gauges(cached)[("kstore_outbox_records_waiting", "shop")] == 4
    assert len(reads) == 1, "kept between scrapes"
    cached.watch_outbox(read, every_s=0)  # a relay made again replaces the gauges: one family per name
    assert gauges(cached) == {}, "left out while the read fails, never stale"
    assert gauges(cached) == {("kstore_outbox_records_waiting", "shop"): 0,
                              ("kstore_outbox_oldest_record_age_seconds", "shop"): 0}
