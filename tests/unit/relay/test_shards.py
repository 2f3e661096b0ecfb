"""An outbox's shard count, on SQLite: an application asking for another count than the outbox has is
told so (both numbers, and how to change it); ``kstore outbox reshard`` refuses while records wait or
a relay runs, and otherwise makes the shards anew numbering on; a writer that read the old shards fails
once, then writes by the new count; ``kstore relay`` makes an application's outbox only when told."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session

from kstore import Settings, migrate
from kstore.cli import cli
from kstore.errors import ConfigurationError, OutboxBusyError, OutboxChangedError
from kstore.ops.outbox import reshard_outbox
from kstore.outbox import Outbox
from kstore.relay.store import Outbox as Tables


@pytest.fixture
def dsn(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrate(Settings(dsn=url))
    return url


@pytest.fixture
def engine(dsn: str) -> sa.Engine:
    return sa.create_engine(dsn)


def shards(engine: sa.Engine, name: str) -> list[tuple[int, int, str]]:
    """(shard, next_seq, incarnation) of each of the outbox's shards."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(  # type: ignore[misc]
            "SELECT shard, next_seq, incarnation FROM kstore_outbox_shards WHERE consumer_group = :g ORDER BY shard"),
            {"g": name})]


def rows(engine: sa.Engine, name: str) -> list[tuple[int, int, bytes]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(  # type: ignore[misc]
            "SELECT shard, seq, value FROM kstore_outbox WHERE consumer_group = :g ORDER BY shard, seq"), {"g": name})]


def publish_all(engine: sa.Engine, name: str) -> None:
    """What a relay's marks do once Kafka has the rows: the outbox drained."""
    tables = Tables(engine, name)
    tables.ensure_shards(1)
    relay = "relay-a"
    for lane in range(tables.lanes):
        epoch = tables.claim(relay, lane, 10.0)
        assert epoch is not None
        marks, _ = tables.published_marks(lane)
        tops = {shard: max([seq for s, seq, _ in rows(engine, name) if s == shard], default=mark)
                for shard, mark in marks.items()}
        assert tables.mark_published(lane, epoch, relay, tops)
        tables.release(relay, lane, epoch)
    tables.leave(relay)


def test_setup_over_an_outbox_of_another_count_raises_naming_both_counts_and_how_to_change_it(
        engine: sa.Engine) -> None:
    Tables(engine, "shop").ensure_shards(1)  # as a relay of an earlier kstore, started first, made it
    events = Outbox("shop", shards=16)
    with pytest.raises(ConfigurationError, match=r"outbox 'shop' has 1 shard\(s\), not the 16 asked for: .*"
                                                 r"kstore outbox reshard shop --shards 16 .*changing-the-shard-count"):
        events.setup(engine)
    # The first produce() (no setup() called) meets it too, and nothing is written by the wrong count.
    with pytest.raises(ConfigurationError, match="not the 16 asked for"), Session(engine) as session, \
            session.begin():
        Outbox("shop", shards=16).produce(session, "orders", "o", key="a")
    with pytest.raises(ConfigurationError, match="not the 16 asked for"), Session(engine) as session, \
            session.begin():
        events.produce(session, "orders", "o", key="a")
    assert rows(engine, "shop") == []


def test_an_outbox_asked_for_without_a_count_takes_the_stored_one_or_the_setting(engine: sa.Engine) -> None:
    Tables(engine, "shop").ensure_shards(1)
    assert Outbox("shop", shards=None).setup(engine) == 1
    assert Outbox("new", Settings(outbox_shards=3), shards=None).setup(engine) == 3
    assert Outbox("new", shards=3).setup(engine) == 3


def test_reshard_refuses_while_records_wait_or_a_relay_runs(dsn: str, engine: sa.Engine) -> None:
    events = Outbox("shop", shards=1)
    events.setup(engine)
    with Session(engine) as session, session.begin():
        events.produce(session, "orders", "o", key="a")
    with pytest.raises(OutboxBusyError, match=r"outbox 'shop' cannot be resharded now: 1 record\(s\) wait to be "
                                              r"published: drain it first"):
        reshard_outbox(Settings(dsn=dsn), "shop", 4)
    publish_all(engine, "shop")
    tables = Tables(engine, "shop")
    tables.ensure_shards(1)
    epoch = tables.claim("relay-b", 0, 30.0)  # a relay holding a live lease
    assert epoch is not None
    with pytest.raises(OutboxBusyError, match=r"relay\(s\) relay-b are running"):
        reshard_outbox(Settings(dsn=dsn), "shop", 4)
    tables.release("relay-b", 0, epoch)
    tables.heartbeat("relay-c", {}, 30.0)  # a relay alive, holding nothing (a spare)
    with pytest.raises(OutboxBusyError, match=r"relay\(s\) relay-c are running"):
        reshard_outbox(Settings(dsn=dsn), "shop", 4)
    tables.leave("relay-c")
    assert len(shards(engine, "shop")) == 1, "a refused reshard changed the shards"
    with pytest.raises(ConfigurationError, match="outbox 'shpo' does not exist in this database; outboxes it "
                                                 "has: shop"):
        reshard_outbox(Settings(dsn=dsn), "shpo", 4)


def test_reshard_numbers_every_new_shard_on_from_the_highest_seq_under_a_new_incarnation(
        dsn: str, engine: sa.Engine) -> None:
    events = Outbox("shop", shards=2)
    events.setup(engine)
    with Session(engine) as session, session.begin():
        for i in range(7):
            events.produce(session, "orders", f"o{i}", key=f"k{i}")
    publish_all(engine, "shop")
    before = shards(engine, "shop")
    highest = max(n for _, n, _ in before)
    done = reshard_outbox(Settings(dsn=dsn), "shop", 4)
    assert (done.before, done.after) == (2, 4)
    after = shards(engine, "shop")
    assert [(s, n) for s, n, _ in after] == [(s, highest) for s in range(4)]
    assert len({inc for _, _, inc in after}) == 1 and after[0][2] != before[0][2]
    with engine.connect() as conn:
        marks = conn.execute(sa.text("SELECT published_seq, epoch, owner FROM kstore_outbox_relays "
                                     "WHERE consumer_group = 'shop'")).all()
    assert {(m.published_seq, m.owner) for m in marks} == {(highest - 1, None)}
    assert min(m.epoch for m in marks) >= 1, "the leases' epochs went back"
    assert reshard_outbox(Settings(dsn=dsn), "shop", 4).before == 4  # the same count: nothing changes
    assert shards(engine, "shop") == after


def test_a_writer_that_read_the_shards_before_a_reshard_fails_once_then_writes_by_the_new_count(
        dsn: str, engine: sa.Engine) -> None:
    events = Outbox("shop", shards=None)
    events.setup(engine)
    reshard_outbox(Settings(dsn=dsn), "shop", 3)
    with pytest.raises(OutboxChangedError, match="was resharded since this process read its shards"), \
            Session(engine) as session, session.begin():
        events.produce(session, "orders", "stale", key="a")
    assert rows(engine, "shop") == []
    with Session(engine) as session, session.begin():
        events.produce(session, "orders", "fresh", key="a")
    assert [(seq, value) for _, seq, value in rows(engine, "shop")] == [(1, b"fresh")]
    # One that asked for the old count is told the new one.
    with pytest.raises(ConfigurationError, match=r"has 3 shard\(s\), not the 1 asked for"):
        Outbox("shop", shards=1).setup(engine)


def test_kstore_outbox_reshard_says_what_it_did_and_refuses_in_one_line(dsn: str, engine: sa.Engine) -> None:
    Outbox("shop", shards=1).setup(engine)
    runner = CliRunner()
    done = runner.invoke(cli, ["outbox", "reshard", "shop", "--shards", "4", "--dsn", dsn])
    assert done.exit_code == 0, done.output
    assert "outbox 'shop': 1 shard(s) -> 4" in done.output
    with Session(engine) as session, session.begin():
        Outbox("shop", shards=4).produce(session, "orders", "o", key="a")
    refused = runner.invoke(cli, ["outbox", "reshard", "shop", "--shards", "2", "--dsn", dsn])
    assert refused.exit_code == 2
    assert refused.output.count("\n") == 1 and "kstore: error: outbox 'shop' cannot be resharded now" in refused.output


@pytest.mark.parametrize(("args", "error"), [
    ([], "give --group GROUP (a pipeline's outbox) or --outbox NAME"),
    (["--group", "g", "--outbox", "o"], "give --group GROUP (a pipeline's outbox) or --outbox NAME"),
    (["--group", "g", "--create"], "--create and --shards are for --outbox NAME"),
    (["--outbox", "o", "--shards", "4"], "--shards is the count --create makes: give --create too"),
])
def test_kstore_relay_publishes_one_outbox_and_creates_only_an_applications_when_told(
        dsn: str, args: list[str], error: str) -> None:
    result = CliRunner().invoke(cli, ["relay", "--dsn", dsn, *args])
    assert result.exit_code == 2 and error in result.output, result.output
