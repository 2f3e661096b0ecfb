"""The harness itself: a real broker and a real PostgreSQL, end to end, without kstore's worker."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
from kafka import KafkaConsumer

from .harness import wait_until


def test_kafka_to_postgres_round_trip(kafka: str, new_topic: Any, produce: Any, postgresql: psycopg.Connection) -> None:
    """1,000 messages on 4 partitions, consumed in a group and inserted: each row arrives once."""
    topic = new_topic(partitions=4)
    sent = produce(topic, (f"m{i}" for i in range(1000)))
    assert {p for _, p, _ in sent} == {0, 1, 2, 3}, "the producer should spread over all partitions"

    with postgresql.cursor() as cur:
        cur.execute("CREATE TABLE received (part int, off bigint, value text)")
    postgresql.commit()

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka, group_id="harness", auto_offset_reset="earliest",
                             enable_auto_commit=False)
    received = 0

    def drain() -> bool:
        nonlocal received
        for tp, records in consumer.poll(timeout_ms=500).items():
            with postgresql.cursor() as cur:
                cur.executemany("INSERT INTO received VALUES (%s, %s, %s)",
                                [(tp.partition, r.offset, r.value.decode()) for r in records])
            postgresql.commit()
            received += len(records)
        return received >= 1000

    try:
        wait_until(drain, timeout=60, interval=0, what="1,000 messages consumed")
    finally:
        consumer.close(autocommit=False)

    with postgresql.cursor() as cur:
        cur.execute("SELECT part, off, value FROM received")
        rows = cur.fetchall()
    counts = Counter((part, off) for part, off, _ in rows)
    assert len(rows) == 1000
    assert set(counts.values()) == {1}
    assert {(p, o) for _, p, o in sent} == set(counts)
    assert sorted(v for _, _, v in rows) == sorted(f"m{i}" for i in range(1000))
