"""Kafka -> database -> Kafka, exactly once: ``Processor.produce`` through the outbox and its relay.

Real ``kstore worker`` and ``kstore relay`` processes, a real broker and a real PostgreSQL (or
SQLite). A ``read_committed`` reader of the output topic must see every expected record once,
and per key in the order the batches committed (tests/outbox_processors.py says how that is told).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from .conftest import TEST_SESSION_TIMEOUT_MS
from .harness import WorkerProcess, read_committed, stored_offsets, wait_until
from .outbox_processors import check_outputs, metadata

BOOKER = "outbox_processors:Booker"


def keyed_values(count: int, keys: int, start: int = 0) -> list[str]:
    return [f"k{(start + i) * 7919 % keys}:{start + i}" for i in range(count)]


def outbox_rows(dsn: str) -> int:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM kstore_outbox")).scalar_one())
    finally:
        engine.dispose()


def booker_tables(dsn: str) -> str:
    engine = sa.create_engine(dsn)
    metadata.create_all(engine)
    engine.dispose()
    return dsn


def wait_done(dsn: str, group: str, sent: list[tuple[str, int, int]], timeout: float = 180) -> None:
    """Until every input message is committed and the outbox is empty (all published, and marked)."""
    ends: dict[tuple[str, int], int] = {}
    for t, p, o in sent:
        ends[(t, p)] = max(ends.get((t, p), 0), o + 1)

    def done() -> bool:
        stored = stored_offsets(dsn, group)
        return all((stored.get(tp) or 0) >= end for tp, end in ends.items()) and outbox_rows(dsn) == 0

    wait_until(done, timeout, interval=0.5, what="every message committed and the outbox empty")


@pytest.fixture
def relays(tmp_path: Path, kafka: str) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``kstore relay`` subprocesses; each is killed at the end of the test if still running."""
    started: list[WorkerProcess] = []

    def start(dsn: str, group: str, env: dict[str, str] | None = None) -> WorkerProcess:
        name = f"r{len(started) + 1}"
        proc = WorkerProcess(["--log-level", "DEBUG", "relay", "--dsn", dsn, "--group", group,
                              "--bootstrap-servers", kafka], env or {}, tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def test_produced_records_are_published_once_in_commit_order_across_a_worker_kill(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """Two workers on 4 partitions, keys spread over every partition; one worker is SIGKILLed
    mid-run (its relay with it): every record once, per key in commit order, the outbox empty."""
    source, out = new_topic(partitions=4), new_topic(partitions=3)
    booker_tables(pg_dsn)
    env = {"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_TEST_BATCH_SLEEP": "0.01"}
    sent = produce(source, keyed_values(3000, keys=40))
    w1 = workers(pg_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "100"])
    w2 = workers(pg_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "100"])
    w1.wait_for_log(r"outbox shard \d+ of group 'booker': published up to", timeout=90)
    w2.wait_for_log(r"claimed", timeout=90)
    w1.kill()
    sent += produce(source, keyed_values(3000, keys=40, start=3000))
    wait_done(pg_dsn, "booker", sent)
    per_key = check_outputs(read_committed(kafka, out), sent)
    assert len(per_key) == 40
    assert w2.terminate() == 0


def test_sqlite_one_worker_publishes_once_across_a_kill(
        sqlite_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """The embedded default: one worker on SQLite, SIGKILLed while publishing, then started again."""
    source, out = new_topic(partitions=2), new_topic(partitions=2)
    booker_tables(sqlite_dsn)
    env = {"KSTORE_TEST_OUT_TOPIC": out}
    sent = produce(source, keyed_values(4000, keys=25))
    w1 = workers(sqlite_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "200"])
    w1.wait_for_log(r"outbox shard \d+ of group 'booker': published up to", timeout=90)
    time.sleep(0.5)
    w1.kill()
    w2 = workers(sqlite_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "200"])
    wait_done(sqlite_dsn, "booker", sent)
    check_outputs(read_committed(kafka, out), sent)
    assert w2.terminate() == 0


def test_standalone_relays_killed_and_paused_publish_nothing_twice(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, relays: Any, kafka: str) -> None:
    """Workers with --no-relay, publishing by standalone relays: one relay is SIGKILLed mid-publish,
    another SIGSTOPped (a zombie holding its shards and an open Kafka transaction); the relays
    that take their shards over fence them in the database and in Kafka. The zombie, woken,
    publishes nothing: every record once, in commit order."""
    source, out = new_topic(partitions=4), new_topic(partitions=3)
    booker_tables(pg_dsn)
    env = {"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_OUTBOX_LEASE_S": "4"}
    relay_env = {"KSTORE_OUTBOX_LEASE_S": "4"}
    sent = produce(source, keyed_values(2000, keys=30))
    w = workers(pg_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "50", "--no-relay"])
    w.wait_for_log(r"committed \d+ messages", timeout=90)
    r1 = relays(pg_dsn, "booker", relay_env)
    r1.wait_for_log(r"published up to", timeout=90)
    r1.kill()
    sent += produce(source, keyed_values(2000, keys=30, start=2000))
    r2 = relays(pg_dsn, "booker", relay_env)
    r2.wait_for_log(r"published up to", timeout=90)
    r2.pause()
    sent += produce(source, keyed_values(2000, keys=30, start=4000))
    r3 = relays(pg_dsn, "booker", relay_env)
    r3.wait_for_log(r"outbox relay \S+ publishes shard", timeout=60)
    wait_done(pg_dsn, "booker", sent)
    r2.resume()
    time.sleep(3)  # the zombie's late transaction, if any, would commit now
    wait_done(pg_dsn, "booker", sent)
    check_outputs(read_committed(kafka, out), sent)
    assert w.terminate() == 0
    assert r3.terminate() == 0
    assert r2.terminate() == 0
    assert TEST_SESSION_TIMEOUT_MS > 0
