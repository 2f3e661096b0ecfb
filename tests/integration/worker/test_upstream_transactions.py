"""Upstream transactions: records of aborted transactions are never processed (kstore reads
with ``isolation_level=read_committed`` unless asked otherwise), and the stored offsets move
past the transaction markers, so a caught-up pipeline's lag is 0.

Against the real broker: a transactional kafka-python producer interleaves aborted and
committed transactions over several partitions, ending in an aborted one on each partition
(a log that ends in abort markers: nothing there to process, but offsets to move past)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from kstore import Settings
from kstore.ops.lag import LagReader
from tests.conftest import KAFKA_CLIENT
from tests.integration.telemetry.test_metrics import by_partition, port_of, scrape
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until, with_driver

PARTITIONS = 3
TRANSACTIONS = 20
PER_TRANSACTION = 100

Offsets = set[tuple[str, int, int]]


def produce_transactions(kafka: str, topic: str) -> tuple[Offsets, Offsets]:
    """TRANSACTIONS transactions of PER_TRANSACTION records over all partitions, every other one
    aborted, the last one aborted. Every record is flushed to the log before its transaction
    ends, so the aborted ones are in the log too. Returns (committed, aborted) record offsets."""
    producer = KafkaProducer(bootstrap_servers=kafka, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
    committed: Offsets = set()
    aborted: Offsets = set()
    try:
        producer.init_transactions()
        for i in range(TRANSACTIONS):
            commit = i % 2 == 0 and i != TRANSACTIONS - 1
            producer.begin_transaction()
            futures = [producer.send(topic, value=f"{'c' if commit else 'a'}{i}-{j}".encode(),
                                     partition=j % PARTITIONS) for j in range(PER_TRANSACTION)]
            producer.flush()
            sent = {(m.topic, m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)}
            if commit:
                producer.commit_transaction()
                committed |= sent
            else:
                producer.abort_transaction()
                aborted |= sent
    finally:
        producer.close()
    return committed, aborted


def log_ends(kafka: str, topic: str, partitions: int = PARTITIONS) -> dict[tuple[str, int], int]:
    """The log end of each partition (past the last transaction marker)."""
    consumer = KafkaConsumer(bootstrap_servers=kafka)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return {(tp.topic, tp.partition): end for tp, end in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def past_every_record(stored: dict[tuple[str, int], int | None], records: Offsets) -> bool:
    last = {(t, p): o for t, p, o in sorted(records)}
    return all((stored.get(tp) or 0) > offset for tp, offset in last.items())


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_aborted_transactions_are_never_processed_and_offsets_reach_the_log_end(
        kafka: str, new_topic: Any, pg_dsn: str, workers: Any, driver: str) -> None:
    """Every committed record's effect exactly once, no aborted record's; the stored offsets end at
    the log end (past the abort markers), and the lag is 0 for the worker and for `kstore top`'s reader."""
    topic = new_topic(PARTITIONS)
    committed, aborted = produce_transactions(kafka, topic)
    ends = log_ends(kafka, topic)
    assert all(end > max(o for t, p, o in aborted if p == tp[1]) for tp, end in ends.items())
    group = f"g-{topic}"
    w = workers(with_driver(pg_dsn, driver), topic, group, args=["--metrics-port", "0"])
    port = port_of(w)
    wait_until(lambda: past_every_record(stored_offsets(pg_dsn, group), committed | aborted), 60,
               what="stored offsets past every record")
    assert_exactly_once(effects(pg_dsn), committed)
    wait_until(lambda: stored_offsets(pg_dsn, group) == ends, 30, what=f"stored offsets at the log ends {ends}")
    wait_until(lambda: set(by_partition(scrape(port), "kstore_lag_messages").values()) == {0.0}, 30,
               what="the worker's lag at 0")
    reader = LagReader(Settings(dsn=pg_dsn, bootstrap_servers=kafka))
    try:
        reading = reader.read(group)
    finally:
        reader.close()
    assert [p.lag_messages for p in reading.partitions] == [0] * PARTITIONS
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), committed)


def test_read_uncommitted_when_asked_delivers_aborted_records(
        kafka: str, new_topic: Any, pg_dsn: str, workers: Any) -> None:
    """``isolation_level=read_uncommitted``, asked for, is used: aborted records are processed too."""
    topic = new_topic(PARTITIONS)
    committed, aborted = produce_transactions(kafka, topic)
    ends = log_ends(kafka, topic)
    group = f"g-{topic}"
    w = workers(pg_dsn, topic, group, args=["--kafka-option", "isolation_level=read_uncommitted"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(committed | aborted), 60, what="every record processed")
    wait_until(lambda: stored_offsets(pg_dsn, group) == ends, 30, what="stored offsets at the log ends")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), committed | aborted)
    # The client option as the worker's log names it: kafka-python's spelling, or librdkafka's.
    assert ("isolation.level='read_uncommitted'" if KAFKA_CLIENT == "confluent"
            else "isolation_level='read_uncommitted'") in w.log


def test_an_open_transaction_is_delivered_once_it_commits(
        kafka: str, new_topic: Any, produce: Any, pg_dsn: str, workers: Any) -> None:
    """Records of a transaction still open are not processed (the consumer stops at the last
    stable offset); once it commits they are, once each, and the offset moves past its marker."""
    topic = new_topic(1)
    group = f"g-{topic}"
    before = set(produce(topic, [f"plain{i}" for i in range(10)], partition=0))
    producer = KafkaProducer(bootstrap_servers=kafka, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
    try:
        producer.init_transactions()
        producer.begin_transaction()
        futures = [producer.send(topic, value=f"open{i}".encode(), partition=0) for i in range(10)]
        producer.flush()
        open_records = {(m.topic, m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)}
        w = workers(pg_dsn, topic, group)
        wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 10}, 60, what="the plain records processed")
        assert set(effects(pg_dsn)) == before  # nothing of the open transaction
        producer.commit_transaction()
    finally:
        producer.close()
    wait_until(lambda: stored_offsets(pg_dsn, group) == log_ends(kafka, topic, 1), 60,
               what="the committed transaction processed, its marker passed")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), before | open_records)
