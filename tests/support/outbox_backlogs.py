"""Outboxes in four states, written at known times, for the tests of every outbox's backlog
(:func:`kstore.relay.tables.backlogs`) on SQLite and PostgreSQL:

- ``idle``: an application's outbox set up, nothing written;
- ``orders``: a group's outbox (what a processor's ``produce()`` writes), every record published;
- ``payments``: a group's, 3 records written at ``T0 + 5 s``, none published;
- ``shop-web``: an application's, 2 records of key ``a`` at ``T0 + 10 s``, then one of ``a`` and one of
  ``d`` (another shard) at ``T0 + 20 s``; the first two are published, so 2 wait, the oldest from ``T0 + 20 s``.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from kstore.outbox import Outbox, Record
from kstore.relay import store, tables, writing
from kstore.relay.lanes import shard_of
from kstore.settings import Settings
from kstore.types import Produced

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
#: Each outbox's (name, records waiting, oldest write).
EXPECTED = [
    ("idle", 0, None),
    ("orders", 0, None),
    ("payments", 3, T0 + timedelta(seconds=5)),
    ("shop-web", 2, T0 + timedelta(seconds=20)),
]


def seed(engine: sa.Engine, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(dsn=dsn)

    def at(seconds: float) -> None:  # the time the outbox stamps the next records it writes with
        monkeypatch.setattr(writing, "now", lambda: T0 + timedelta(seconds=seconds))

    Outbox("idle", settings, shards=2).setup(engine)

    at(0)
    orders = group_outbox(engine, "orders", shards=2)
    write(engine, orders, [Produced("t", b"o", f"k{i}".encode()) for i in range(3)])
    publish(orders, {shard: 10**6 for shard in range(orders.shards)})

    at(5)
    payments = group_outbox(engine, "payments", shards=4)
    write(engine, payments, [Produced("t", b"p", f"k{i}".encode()) for i in range(3)])

    shop = Outbox("shop-web", settings, shards=2)
    at(10)
    produce(engine, shop, [Record("t", "1", key="a"), Record("t", "2", key="a")])
    at(20)
    produce(engine, shop, [Record("t", "3", key="a"), Record("t", "4", key="d")])
    a, d = (shard_of(Produced("t", b"", key), 2) for key in (b"a", b"d"))
    assert a != d, "keys a and d fall in different shards"
    publish(group_outbox(engine, "shop-web", shards=2), {a: 2})


def group_outbox(engine: sa.Engine, name: str, shards: int) -> store.Outbox:
    found = store.Outbox(engine, name)
    found.ensure_shards(shards)
    return found


def write(engine: sa.Engine, outbox: store.Outbox, records: list[Produced]) -> None:
    with engine.connect() as conn, conn.begin():
        outbox.write(conn, records)


def produce(engine: sa.Engine, outbox: Outbox, records: list[Record]) -> None:
    with Session(engine) as session, session.begin():
        outbox.produce_many(session, records)


def publish(outbox: store.Outbox, marks: dict[int, int]) -> None:
    """Mark each shard of ``marks`` published up to its seq, as its relay does (holding its lane's lease)."""
    for shard, seq in marks.items():
        epoch = outbox.claim("test-relay", shard, 30.0)
        assert epoch is not None
        assert outbox.mark_published(shard, epoch, "test-relay", {shard: seq})


def rows_waiting(engine: sa.Engine) -> dict[str, int]:
    """The rows in the outbox table, counted by outbox: what the backlog's counts must agree with."""
    t = tables.build_tables().outbox
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(t.c.consumer_group, sa.func.count()).group_by(t.c.consumer_group)).all())
