"""Async handlers against real Kafka and PostgreSQL: a batch's messages run concurrently, and
the pipeline stays exactly once, and in key order, across a SIGKILL, a rebalance, poison
messages and an online reset; what they produce is published in the order of their writes."""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.harness import REPO_DIR, read_committed, stored_offsets, wait_until
from tests.support.outbox_processors import products, stock_metadata

pytestmark = pytest.mark.integration

GROUP = "async-keyed"
#: Few keys, drawn at random: one key's messages are often next to each other, so running them
#: side by side (were key order not kept) would reorder them.
KEYS = 8


def rows(dsn: str, query: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(query), params).all())
    finally:
        engine.dispose()


def send(producer: Any, topic: str, start: int, count: int, poison: dict[int, str]) -> None:
    rng = random.Random(start)
    for n in range(start, start + count):
        key = f"k{rng.randrange(KEYS)}"
        producer.send(topic, key=key.encode(), value=f"{key}:{n}{poison.get(n, '')}".encode())
    producer.flush()


def test_async_handlers_are_exactly_once_and_in_key_order_across_kill_rebalance_poison_and_reset(
    pg_dsn: str, kafka: str, new_topic: Callable[..., str], producer: Any, workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=2)
    poison = {1234: "-poison", 5678: "-reject"}
    env = {"KSTORE_MAX_CONCURRENCY": "4", "KSTORE_TEST_MAX_SLEEP_MS": "4"}
    args = ["--max-batch-size", "200", "--on-error", "dead_letter", "--max-attempts", "2"]

    def done() -> int:
        return int(rows(pg_dsn, "SELECT count(*) FROM effects")[0][0])

    send(producer, topic, 0, 4000, poison)
    w1 = workers(pg_dsn, topic, GROUP, processor="processors:AsyncKeyed", env=env, args=args)
    wait_until(lambda: done() >= 1000, 120, what="1,000 effects")
    w1.kill()  # SIGKILL, mid-stream: its batch in flight never commits

    w2 = workers(pg_dsn, topic, GROUP, processor="processors:AsyncKeyed", env=env, args=args)
    send(producer, topic, 4000, 3000, poison)
    wait_until(lambda: done() >= 4500, 120, what="4,500 effects")
    w3 = workers(pg_dsn, topic, GROUP, processor="processors:AsyncKeyed", env=env, args=args)  # a rebalance
    w3.wait_for_log(r"claimed ", 60)
    send(producer, topic, 7000, 3000, poison)

    # An online reset of partition 0, a few hundred messages back, while the workers run.
    wait_until(lambda: (stored_offsets(pg_dsn, GROUP).get((topic, 0)) or 0) > 3000, 120, what="partition 0 past 3000")
    target = (stored_offsets(pg_dsn, GROUP)[(topic, 0)] or 0) - 300
    r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "set", "--group", GROUP, "--topic", topic,
                        "--partition", "0", "--to-offset", str(target), "--execute", "--dsn", pg_dsn,
                        "--bootstrap-servers", kafka, "--reason", "async test"],
                       cwd=REPO_DIR, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    [(moved_from, moved_to)] = rows(pg_dsn, "SELECT from_offset, to_offset FROM kstore_offset_history "
                                            "WHERE reason LIKE '%async test%'")
    assert moved_to == target < moved_from

    ends = _ends(kafka, topic)
    wait_until(lambda: stored_offsets(pg_dsn, GROUP) == {(topic, p): end for p, end in ends.items()}, 180,
               what="every partition to be committed to its end")
    assert w2.terminate() == 0 and w3.terminate() == 0

    # Exactly once: every message has one effect, but the poison ones (dead-lettered, none) and those
    # the reset replayed (two: one before it, one after).
    effect_rows = rows(pg_dsn, "SELECT partition_id, kafka_offset, value, id FROM effects WHERE topic = :t", t=topic)
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for p, o, _, _ in effect_rows:
        counts[(p, o)] += 1
    letters = {(p, o) for p, o in rows(pg_dsn, 'SELECT partition_id, "offset" FROM kstore_dead_letters '
                                               "WHERE topic = :t", t=topic)}
    values = {(p, o): v for p, o, v, _ in effect_rows}
    poisoned = {(p, o) for p, end in ends.items() for o in range(end) if (p, o) not in values}
    assert letters == poisoned and len(letters) == 2, (letters, poisoned)
    wrong = {(p, o): counts[(p, o)] for p, end in ends.items() for o in range(end) if (p, o) not in letters
             and counts[(p, o)] != (2 if p == 0 and moved_to <= o < moved_from else 1)}
    assert not wrong, f"{len(wrong)} messages with the wrong number of effects, e.g. {sorted(wrong.items())[:5]}"

    # Key order: per key, the effects were written in offset order, in the pass before the reset
    # (first effects) and in the one after (last effects).
    for pick in (min, max):
        by_message: dict[tuple[int, int], int] = {}
        for p, o, _, id_ in effect_rows:
            by_message[(p, o)] = pick(by_message.get((p, o), id_), id_)
        per_key: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
        for (p, o), id_ in by_message.items():
            per_key[(p, values[(p, o)].split(":")[0])].append((o, id_))
        for key, seq in per_key.items():
            ids = [id_ for _, id_ in sorted(seq)]
            assert ids == sorted(ids), f"key {key}: its messages ran out of offset order"
    # And they did run concurrently: a batch's effects were not written in offset order overall.
    ids_by_offset = [id_ for _, id_ in sorted((o, i) for p, o, _, i in effect_rows if p == 1)]
    assert ids_by_offset != sorted(ids_by_offset)


def _ends(kafka: str, topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        return {tp.partition: end for tp, end in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def test_a_stop_signal_cancels_an_async_batch_that_outlives_the_shutdown_timeout_and_rolls_it_back(
    pg_dsn: str, new_topic: Callable[..., str], producer: Any, workers: Callable[..., Any], tmp_path: Path,
) -> None:
    """One handler never returns; the others finished and wrote. SIGTERM waits for the batch at most
    ``shutdown_timeout_s``, then its tasks are cancelled and its transaction rolled back: nothing of
    it commits, and the worker still leaves cleanly."""
    topic = new_topic(partitions=1)
    send(producer, topic, 0, 50, {0: "-hang"})
    hang = tmp_path / "hang"
    w = workers(pg_dsn, topic, GROUP, processor="processors:AsyncKeyed",
                env={"KSTORE_TEST_HANG_FILE": str(hang), "KSTORE_SHUTDOWN_TIMEOUT_S": "1"})
    wait_until(hang.exists, 60, what="the handler that hangs")
    w.proc.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0
    assert "did not finish within 1s of the stop signal: rolled back" in w.log
    assert "handler of offset 0 cancelled" in w.log
    assert rows(pg_dsn, "SELECT count(*) FROM effects")[0][0] == 0
    assert stored_offsets(pg_dsn, GROUP).get((topic, 0)) in (None, 0)


#: Each product's stock before the orders, and how many orders there are (on PRODUCTS products).
STOCK, ORDERS, PRODUCTS = 10_000, 600, 5


def test_records_of_concurrent_handlers_are_published_in_the_order_of_their_database_writes(
    pg_dsn: str, kafka: str, new_topic: Callable[..., str], producer: Any, workers: Callable[..., Any],
) -> None:
    """Orders on few products, each its own key, so 16 run side by side; each handler awaits, takes one
    from its product's stock (``UPDATE ... RETURNING``), awaits again, and produces the stock left
    keyed by the product (tests/support/outbox_processors.py's StockKeeper). Per product, a read_committed
    reader must see the stock going down one by one and ending where the database's is: the order of
    the writes, not the orders' offsets. A rejected order's record and a poison order's (its batch
    failed and ran again without it) are left out; nothing is published twice."""
    source, out = new_topic(partitions=2), new_topic(partitions=3)
    engine = sa.create_engine(pg_dsn)
    stock_metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(products.insert(), [{"id": f"p{i}", "stock": STOCK} for i in range(PRODUCTS)])
    engine.dispose()
    bad = {100: "reject", 321: "poison"}
    for n in range(ORDERS):
        producer.send(source, key=f"o{n}".encode(), value=f"p{n % PRODUCTS}:{bad.get(n, '')}".encode())
    producer.flush()
    w = workers(pg_dsn, source, "stock-keeper", "outbox_processors:StockKeeper",
                env={"KSTORE_TEST_OUT_TOPIC": out},
                args=["--max-batch-size", "200", "--max-attempts", "2"])
    ends = _ends(kafka, source)
    wait_until(lambda: stored_offsets(pg_dsn, "stock-keeper") == {(source, p): e for p, e in ends.items()}
               and rows(pg_dsn, "SELECT count(*) FROM kstore_outbox")[0][0] == 0,
               120, what="every order committed and published")
    assert w.terminate() == 0

    assert rows(pg_dsn, "SELECT count(*) FROM kstore_dead_letters")[0][0] == 2
    stock = dict(rows(pg_dsn, "SELECT id, stock FROM products"))
    published: dict[str, list[int]] = defaultdict(list)
    for key, raw in read_committed(kafka, out):
        value = json.loads(raw)
        assert key == value["product"].encode()
        published[value["product"]].append(value["stock_left"])
    assert sum(STOCK - left for left in stock.values()) == ORDERS - len(bad)
    for product, seq in sorted(published.items()):
        swapped = sum(a <= b for a, b in itertools.pairwise(seq))
        assert seq == list(range(STOCK - 1, stock[product] - 1, -1)), \
            f"{product}: published {len(seq)} records, {swapped} pair(s) out of the writes' order, the last " \
            f"{seq[-1]} where the database has {stock[product]}"
    assert sorted(published) == sorted(stock)
