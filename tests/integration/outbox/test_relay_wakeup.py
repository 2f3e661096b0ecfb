"""A shard's idle relay is woken by the one writer that takes the seq it waits for (``wake_seq``).

Writers NOTIFY only then (PostgreSQL commits NOTIFYing transactions one at a time): counted here on
a LISTEN connection of the test's own, on both drivers and by each way a write goes. And a relay
whose poll interval is a minute publishes each new record within seconds, again and again, with
writes racing its going to sleep, rolled back, and concurrent: a wake-up lost would show as a wait
of the poll interval.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa
from kafka import KafkaConsumer, TopicPartition

from kstore import Settings
from kstore.db.store import make_engine
from kstore.relay.loop import Relay
from kstore.relay.store import Outbox
from kstore.relay.tables import CHANNEL
from kstore.relay.writing import FUSED_MAX_ROWS
from kstore.types import Produced
from tests.support.harness import wait_until, with_driver

pytestmark = pytest.mark.integration

#: How each write goes: one statement (a few records of a shard), UPDATE ... RETURNING then the
#: rows (more records), the plain path.
WAYS = ("fused", "returning", "plain")


@pytest.fixture(params=["psycopg2", "psycopg"])
def engine(request: Any, pg_dsn: str) -> Iterator[sa.Engine]:
    e = make_engine(Settings(dsn=with_driver(pg_dsn, request.param)))
    yield e
    e.dispose()


class Notifications:
    """The NOTIFYs on :data:`CHANNEL` with one group's payload, counted on a connection of the test's own."""

    def __init__(self, dsn: str, group: str) -> None:
        url = sa.engine.make_url(dsn)
        self.conn = psycopg2.connect(host=url.host, port=url.port, user=url.username, password=url.password,
                                     dbname=url.database)
        self.conn.autocommit = True
        self.group = group
        self.seen = 0
        with self.conn.cursor() as cur:
            cur.execute(f"LISTEN {CHANNEL}")

    def count(self) -> int:
        """Those of every transaction committed so far: a NOTIFY of the test's own, sent now, comes
        after them all (notifications are delivered in commit order), so wait for it."""
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, sentinel))
        deadline = time.monotonic() + 10
        while True:
            self.conn.poll()
            payloads = [n.payload for n in self.conn.notifies]
            self.conn.notifies.clear()
            self.seen += payloads.count(self.group)
            if sentinel in payloads:
                return self.seen
            assert time.monotonic() < deadline, "the test's own NOTIFY never came back"
            time.sleep(0.01)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def outbox(engine: sa.Engine, pg_dsn: str) -> Iterator[tuple[Outbox, Notifications]]:
    box = Outbox(engine, f"wake-{uuid.uuid4().hex[:8]}")
    box.ensure_shards(1)
    heard = Notifications(pg_dsn, box.group)
    yield box, heard
    heard.close()


def write(box: Outbox, way: str, commit: bool = True, hold_s: float = 0.0) -> None:
    """One transaction writing to the outbox's one shard, the ``way`` given; committed or rolled back."""
    box.plain = way == "plain"
    count = FUSED_MAX_ROWS + 1 if way == "returning" else 1
    with box.engine.connect() as conn, conn.begin() as tx:
        box.write(conn, [Produced("t", b"v", b"k")] * count)
        time.sleep(hold_s)
        if not commit:
            tx.rollback()


def next_seq(box: Outbox) -> int:
    return box.state()[0].next_seq


@pytest.mark.parametrize("way", WAYS)
def test_writers_notify_only_for_the_seq_the_idle_relay_waits_for(outbox: Any, way: str) -> None:
    box, heard = outbox
    for _ in range(3):  # no relay has asked yet (wake_seq is NULL)
        write(box, way)
    assert heard.count() == 0
    assert box.sleep_until_written({0: next_seq(box) - 1}) == "sleep", \
        "nothing was committed past what the relay published"
    for _ in range(3):
        write(box, way)
    assert heard.count() == 1, "only the write that took wake_seq NOTIFYs"
    # A relay behind (rows committed past what it published) is told to publish them, and asks for no
    # NOTIFY (it asks again once it has caught up): the next write sends none.
    assert box.sleep_until_written({0: next_seq(box) - 2}) == "publish"
    write(box, way)
    assert heard.count() == 1
    assert box.sleep_until_written({0: next_seq(box) - 1}) == "sleep"
    write(box, way)
    assert heard.count() == 2


@pytest.mark.parametrize("way", WAYS)
def test_the_writer_after_a_rolled_back_one_notifies(outbox: Any, way: str) -> None:
    box, heard = outbox
    write(box, way)
    box.sleep_until_written({0: next_seq(box) - 1})
    write(box, way, commit=False)
    assert heard.count() == 0
    write(box, way)
    write(box, way)
    assert heard.count() == 1


@pytest.mark.parametrize("way", WAYS)
def test_of_concurrent_writers_one_notifies(outbox: Any, way: str) -> None:
    box, heard = outbox
    for round_ in range(3):
        assert box.sleep_until_written({0: next_seq(box) - 1}) == "sleep"
        threads = [threading.Thread(target=write, args=(box, way, i % 3 != 0, random.random() * 0.02))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The first writer to take the lock may be one of those that roll back: the next one takes its seq.
        assert heard.count() == round_ + 1


def ask_while_a_writer_holds_the_shard(box: Outbox, published: int) -> str:
    """The relay's ask while a writer holds the shard's row lock (it wrote, and has not committed);
    the writer commits once the ask has returned (or after 5 s: an ask that waited for it)."""
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:
        with box.engine.connect() as conn, conn.begin():
            box.write(conn, [Produced("t", b"v", b"k")])
            holding.set()
            release.wait(5)

    thread = threading.Thread(target=writer)
    thread.start()
    assert holding.wait(30), "the writer to write"
    started = time.monotonic()
    answer = box.sleep_until_written({0: published})
    took = time.monotonic() - started
    release.set()
    thread.join()
    assert took < 2.5, "the ask waited for the writer's lock"
    return answer


def test_a_relays_ask_never_waits_for_a_writer_holding_the_shard(outbox: Any) -> None:
    """A writer holds the shard's row lock until its COMMIT: the relay's ask does not queue behind it
    (every later writer would queue behind the ask) but is told to look again, and then sees its row."""
    box, heard = outbox
    published = next_seq(box) - 1
    assert ask_while_a_writer_holds_the_shard(box, published) == "busy"
    assert box.sleep_until_written({0: published}) == "publish", "the relay missed a row committed before its ask"
    assert heard.count() == 0


def test_a_writer_holding_the_shard_after_the_relay_asked_notifies_and_the_relay_sleeps(outbox: Any) -> None:
    """The relay asked already (``wake_seq`` is the committed ``next_seq``): a writer holding the lock
    now takes that seq, so the relay may sleep at once; the writer's COMMIT wakes it."""
    box, heard = outbox
    assert box.sleep_until_written({0: next_seq(box) - 1}) == "sleep"
    assert ask_while_a_writer_holds_the_shard(box, next_seq(box) - 1) == "sleep"
    assert heard.count() == 1, "the writer that took wake_seq NOTIFYs"


# -- a relay, publishing -----------------------------------------------------------------------------

def readable(consumer: KafkaConsumer, value: bytes, timeout_s: float, seen: list[bytes]) -> float | None:
    """Seconds until ``value`` is read (read_committed), or None if not within ``timeout_s``; every
    value read goes to ``seen``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        for records in consumer.poll(timeout_ms=50).values():
            seen.extend(r.value for r in records)
            if any(r.value == value for r in records):
                return time.monotonic() - start
    return None


def test_an_idle_relay_publishes_each_new_record_at_once_not_at_its_poll(
        pg_dsn: str, kafka: str, new_topic: Any) -> None:
    out = new_topic(partitions=1)
    engine = make_engine(Settings(dsn=pg_dsn))
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, outbox_shards=2, outbox_lease_s=10,
                        outbox_poll_interval_s=60)
    relay = Relay(settings, f"wake-{uuid.uuid4().hex[:8]}", engine)
    box = relay.outbox
    box.ensure_shards(2)
    consumer = KafkaConsumer(bootstrap_servers=kafka, isolation_level="read_committed", enable_auto_commit=False,
                             group_id=None)
    consumer.assign([TopicPartition(out, 0)])
    consumer.seek_to_beginning()
    rng = random.Random(7)
    seen: list[bytes] = []
    written: list[bytes] = []
    waits: list[float] = []
    relay.start()
    try:
        for key in (b"a", b"b", b"c", b"d"):  # both shards taken, their producers made, gone to sleep
            _write_one(engine, box, out, b"warm-" + key, key)
            written.append(b"warm-" + key)
        assert readable(consumer, b"warm-d", 60, seen) is not None
        wait_until(lambda: set(written) <= set(seen) or readable(consumer, b"", 0.2, seen), 60,
                   what="the warm-up records")
        time.sleep(0.5)
        for i in range(60):
            # Right after the last record was read, the relay is going to sleep (its mark, its ask):
            # no pause races that; longer ones find it asleep.
            time.sleep(rng.choice([0, 0, 0.001, 0.003, 0.01, 0.05, 0.2]))
            if i % 7 == 3:
                with engine.connect() as conn, conn.begin() as tx:  # takes wake_seq, then gives it back
                    box.write(conn, [Produced(out, b"never", f"k{i}".encode())])
                    tx.rollback()
            batch = [(f"r{i}-{n}".encode(), f"k{i}-{n}".encode()) for n in range(1 if i % 5 else 4)]
            writers = [threading.Thread(target=_write_one, args=(engine, box, out, value, key)) for value, key in batch]
            for t in writers:
                t.start()
            for t in writers:
                t.join()
            written.extend(value for value, _ in batch)
            took = readable(consumer, batch[-1][0], 15, seen)
            assert took is not None, (f"record {batch[-1][0]!r} was not published within 15s: a wake-up was lost "
                                      f"(the relay's poll interval is 60s)")
            waits.append(took)
        wait_until(lambda: set(written) <= set(seen) or readable(consumer, b"", 0.2, seen), 15,
                   what="every record written")
    finally:
        relay.close()
        consumer.close()
        engine.dispose()
    assert relay.error is None
    assert max(waits) < 15
    assert sorted(seen) == sorted(written), "each committed record once, no rolled-back one"


def _write_one(engine: sa.Engine, box: Outbox, topic: str, value: bytes, key: bytes) -> None:
    with engine.connect() as conn, conn.begin():
        box.write(conn, [Produced(topic, value, key)])

