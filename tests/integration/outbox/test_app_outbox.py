"""kstore.outbox from application code, on real PostgreSQL and Kafka: 50 concurrent request transactions
place orders and announce them through an application outbox, some roll back (whole, or a savepoint
of theirs), and ``kstore relay --outbox`` publishes them, SIGKILLed mid-way and started again. A
``read_committed`` reader sees every committed order's event once, per customer in commit order,
and nothing of what rolled back."""

from __future__ import annotations

import json
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kstore import Settings
from kstore.outbox import Outbox, Record
from tests.support.harness import WorkerProcess, outbox_rows, read_committed, wait_until

pytestmark = pytest.mark.integration

metadata = sa.MetaData()
orders = sa.Table("orders", metadata, sa.Column("id", sa.Integer, primary_key=True),
                  sa.Column("customer", sa.String(20), nullable=False), sa.Column("n", sa.Integer, nullable=False))
customers = sa.Table("customers", metadata, sa.Column("customer", sa.String(20), primary_key=True),
                     sa.Column("orders", sa.Integer, nullable=False))
COUNT = sa.text("INSERT INTO customers (customer, orders) VALUES (:c, 1) "
                "ON CONFLICT (customer) DO UPDATE SET orders = customers.orders + 1 RETURNING orders")
THREADS, PER_THREAD, CUSTOMERS = 50, 40, 30


@pytest.fixture
def relays(tmp_path: Path, kafka: str) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(dsn: str, outbox: str) -> WorkerProcess:
        proc = WorkerProcess(["--log-level", "DEBUG", "relay", "--dsn", dsn, "--outbox", outbox,
                              "--bootstrap-servers", kafka], {}, tmp_path / f"r{len(started) + 1}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def place_orders(engine: sa.Engine, events: Outbox, topic: str, thread: int) -> None:
    """One request thread: each order in a transaction of its own; every 7th fails after producing
    (rolled back), every 5th produces a record in a savepoint it rolls back."""
    for i in range(PER_THREAD):
        order_id = thread * PER_THREAD + i
        customer = f"c{order_id * 7919 % CUSTOMERS}"
        try:
            with Session(engine) as session, session.begin():
                # The customer's row lock orders one customer's transactions: n follows commit order.
                n = session.execute(COUNT, {"c": customer}).scalar_one()
                session.execute(orders.insert(), {"id": order_id, "customer": customer, "n": n})
                events.produce(session, topic, {"order": order_id, "customer": customer, "n": n}, key=customer)
                if order_id % 5 == 0:
                    savepoint = session.begin_nested()
                    events.produce(session, topic, {"ghost": order_id}, key=customer)
                    savepoint.rollback()
                if order_id % 7 == 3:
                    raise RuntimeError("the request failed")
        except RuntimeError:
            pass


def test_concurrent_request_transactions_announce_each_committed_order_once_in_commit_order(
        pg_dsn: str, new_topic: Any, kafka: str, relays: Any) -> None:
    out = new_topic(partitions=3)
    engine = sa.create_engine(pg_dsn, pool_size=THREADS, max_overflow=0)
    metadata.create_all(engine)
    events = Outbox("shop-web", Settings(dsn=pg_dsn), shards=8)
    assert events.setup(engine) == 8
    r1 = relays(pg_dsn, "shop-web")
    threads = [threading.Thread(target=place_orders, args=(engine, events, out, t)) for t in range(THREADS)]
    for t in threads[:THREADS // 2]:
        t.start()
    r1.wait_for_log(r"outbox shard \d+ of group 'shop-web': published up to", timeout=90)
    r1.kill()
    r2 = relays(pg_dsn, "shop-web")
    for t in threads[THREADS // 2:]:
        t.start()
    for t in threads:
        t.join(timeout=300)
    with engine.begin() as conn:  # and one request on a plain Connection, two records in one call
        conn.execute(orders.insert(), {"id": 10_000, "customer": "conn", "n": 1})
        events.produce_many(conn, [Record(out, {"order": 10_000, "customer": "conn", "n": 1}, key="conn"),
                                   Record(out, {"order": 10_000, "customer": "conn", "n": 2}, key="conn")])

    with engine.connect() as conn:
        placed = {r.id: (r.customer, r.n) for r in conn.execute(sa.select(orders))}
    committed = THREADS * PER_THREAD - sum(1 for i in range(THREADS * PER_THREAD) if i % 7 == 3) + 1
    assert len(placed) == committed

    wait_until(lambda: outbox_rows(pg_dsn) == 0, 120, interval=0.5, what="the outbox published and emptied")
    seen = [json.loads(value) for _, value in read_committed(kafka, out)]
    assert not [e for e in seen if "ghost" in e], "a rolled-back savepoint's record was published"
    per_order = defaultdict(int)
    per_customer: dict[str, list[int]] = defaultdict(list)
    for e in seen:
        per_order[e["order"]] += 1
        per_customer[e["customer"]].append(e["n"])
    assert set(per_order) == set(placed), "an order is missing, or a rolled-back one was announced"
    assert [o for o, count in per_order.items() if count != (2 if o == 10_000 else 1)] == [], "announced twice"
    for customer, ns in per_customer.items():
        assert ns == list(range(1, len(ns) + 1)), f"{customer}'s orders out of commit order"
    assert r2.terminate() == 0
    engine.dispose()


class _Base(DeclarativeBase):
    pass


class _Parcel(_Base):
    __tablename__ = "parcels"
    id: Mapped[int] = mapped_column(primary_key=True)


def test_a_sessions_own_changes_are_flushed_before_the_outbox_locks_its_shards(pg_dsn: str) -> None:
    """The outbox's write in the session's commit comes after the session's pending changes, so they
    are never sent while the transaction holds the shards' locks."""
    engine = sa.create_engine(pg_dsn)
    _Base.metadata.create_all(engine)
    events = Outbox(f"flush-{uuid.uuid4().hex[:8]}", Settings(dsn=pg_dsn), shards=2)
    events.setup(engine)
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda _c, _cur, statement, *_: statements.append(statement))
    with Session(engine) as session, session.begin():
        session.add(_Parcel(id=1))
        events.produce(session, "parcels", {"id": 1}, key="p1")
    engine.dispose()
    parcel = next(i for i, s in enumerate(statements) if "INSERT INTO parcels" in s)
    locked = next(i for i, s in enumerate(statements) if "outbox_shards" in s and "next_seq" in s)
    assert parcel < locked, statements
