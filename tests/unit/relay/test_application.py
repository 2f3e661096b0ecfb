"""kstore.outbox in an application's own transactions, on SQLite: what commits is in the outbox, numbered
per shard; what rolls back (a transaction, or a savepoint) is not; misuse is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from kstore import KstoreError, ProduceError, Settings, migrate
from kstore.outbox import Outbox, Record


@pytest.fixture
def engine(tmp_path: Path) -> sa.Engine:
    dsn = f"sqlite:///{tmp_path / 'app.db'}"
    migrate(Settings(dsn=dsn))
    return sa.create_engine(dsn)


def rows(engine: sa.Engine, name: str = "shop") -> list[tuple[int, int, str, bytes | None, bytes | None]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(  # type: ignore[misc]
            "SELECT shard, seq, topic, key, value FROM kstore_outbox WHERE consumer_group = :g ORDER BY shard, seq"),
            {"g": name})]


def test_a_sessions_records_are_written_when_it_commits_in_order_per_shard(engine: sa.Engine) -> None:
    events = Outbox("shop", shards=4)
    assert events.setup(engine) == 4
    with Session(engine) as session, session.begin():
        for i in range(6):
            events.produce(session, "orders", {"n": i}, key=f"k{i % 2}")
        assert rows(engine) == []  # nothing written before the commit
    written = rows(engine)
    assert len(written) == 6
    for key in (b"k0", b"k1"):
        mine = [r for r in written if r[3] == key]
        assert len({r[0] for r in mine}) == 1, "one key's records are in one shard"
        assert [r[4] for r in mine] == [f'{{"n":{i}}}'.encode() for i in range(6) if f"k{i % 2}".encode() == key]


def test_a_rolled_back_transaction_produces_nothing(engine: sa.Engine) -> None:
    events = Outbox("shop")
    events.setup(engine)
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        events.produce(session, "orders", "lost", key="a")
        raise RuntimeError("the request failed")
    with Session(engine) as session, session.begin():
        events.produce(session, "orders", "kept", key="a")
    assert [r[4] for r in rows(engine)] == [b"kept"]


def test_a_rolled_back_savepoint_drops_only_its_own_records(engine: sa.Engine) -> None:
    events = Outbox("shop")
    events.setup(engine)
    with Session(engine) as session, session.begin():
        events.produce(session, "orders", "before", key="a")
        savepoint = session.begin_nested()
        events.produce(session, "orders", "inside", key="a")
        savepoint.rollback()
        with session.begin_nested():
            events.produce(session, "orders", "kept-savepoint", key="a")
        events.produce(session, "orders", "after", key="a")
    assert [r[4] for r in rows(engine)] == [b"before", b"kept-savepoint", b"after"]


def test_a_connections_records_are_written_in_its_transaction(engine: sa.Engine) -> None:
    events = Outbox("shop")
    events.setup(engine)
    with engine.connect() as conn:
        with conn.begin():
            events.produce_many(conn, [Record("orders", "one", key="a"), Record("orders", "two", key="b")])
        with conn.begin() as transaction:
            events.produce(conn, "orders", "rolled-back", key="a")
            transaction.rollback()
        with pytest.raises(KstoreError, match="needs a transaction begun"):
            events.produce(conn, "orders", "nowhere", key="a")
    assert sorted(r[4] for r in rows(engine)) == [b"one", b"two"]


def test_outboxes_are_kept_apart_by_name(engine: sa.Engine) -> None:
    shop, billing = Outbox("shop"), Outbox("billing", shards=2)
    with Session(engine) as session, session.begin():
        shop.produce(session, "orders", "o", key="a")
        billing.produce(session, "invoices", "i", key="a")
    assert [r[4] for r in rows(engine, "shop")] == [b"o"] and [r[4] for r in rows(engine, "billing")] == [b"i"]


def test_misuse_is_one_clear_error(engine: sa.Engine) -> None:
    events = Outbox("shop", Settings(outbox_max_record_bytes=100))
    with pytest.raises(KstoreError, match="writes in a SQLAlchemy Session"):
        events.produce(engine, "orders", "v")
    with Session(engine) as session, session.begin(), pytest.raises(ProduceError):
        events.produce(session, "orders", "x" * 200)
    with pytest.raises(KstoreError, match="needs a name"):
        Outbox("")
