"""A position that leaves the log while a worker owns the partition is never moved silently.

kstore's consumer has no reset policy of its own (``auto_offset_reset="none"``): when the log
start passes the position (retention, ``delete-records``), kstore processes what it already
fetched, then logs one ERROR line naming the partition, the offset it wanted, where the log
now starts and how many messages were skipped, records it in the reset history (the stored
offset moves with an epoch bump), counts it in ``kstore_position_resets_total`` and carries on
from ``start_from`` (the log start by default). Against the real broker: the worker is stopped
(SIGSTOP, well inside its session timeout, so it keeps its partitions) while records are
produced and deleted past its position."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import TopicPartition

from tests.integration.telemetry.test_metrics import port_of, scrape, total
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until

#: What the seam between the engine and a Kafka client promises: on each client.
pytestmark = [pytest.mark.contract, pytest.mark.usefixtures("kafka_client")]

#: Long enough that a stopped worker keeps its partitions for the whole test.
SESSION_TIMEOUT_MS = 45_000
#: The longest a fetch waits at the broker: one in flight when the worker stops is answered (empty) soon.
FETCH_MAX_WAIT_MS = 100
#: Its option's name in the worker's Kafka client.


def fetch_max_wait() -> str:
    """The option by the test's client's name (the ``kafka_client`` fixture sets it in the environment)."""
    return "fetch.wait.max.ms" if os.environ["KSTORE_KAFKA_CLIENT"] == "confluent" else "fetch_max_wait_ms"


def history(dsn: str, group: str) -> list[tuple[int, int | None, int | None, int, str]]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT partition_id, from_offset, to_offset, epoch, reason FROM kstore_offset_history "
                "WHERE consumer_group = :g ORDER BY id"), {"g": group}).all()
    finally:
        engine.dispose()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def epochs(dsn: str, group: str) -> dict[int, int]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT partition_id, epoch FROM kstore_offsets WHERE consumer_group = :g"),
                                {"g": group}).all()
    finally:
        engine.dispose()
    return {r[0]: r[1] for r in rows}


def test_records_deleted_past_the_position_are_reported_and_the_worker_carries_on(
        kafka: str, admin: Any, new_topic: Any, produce: Any, pg_dsn: str, workers: Any) -> None:
    topic = new_topic(2)
    group = f"g-{topic}"
    sent = set(produce(topic, [f"a{i}" for i in range(100)], partition=0))
    sent |= set(produce(topic, [f"b{i}" for i in range(100)], partition=1))
    w = workers(pg_dsn, topic, group, args=["--metrics-port", "0", "--kafka-option",
                                            f"{fetch_max_wait()}={FETCH_MAX_WAIT_MS}"],
                env={"KSTORE_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS), "KSTORE_HEARTBEAT_INTERVAL_MS": "3000"})
    port = port_of(w)
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 100, (topic, 1): 100}, 60,
               what="the first messages processed")
    claimed = epochs(pg_dsn, group)

    w.pause()
    # Not a timing assertion: a fetch in flight when the worker stopped is answered (empty, after
    # FETCH_MAX_WAIT_MS) before anything new is produced, so the stopped worker holds no record
    # of what follows in its socket.
    time.sleep(20 * FETCH_MAX_WAIT_MS / 1000)
    later = produce(topic, [f"c{i}" for i in range(100)], partition=0)
    assert [o for _, _, o in later] == list(range(100, 200))
    admin.delete_records({TopicPartition(topic, 0): 150})  # 100..149 deleted, never processed
    w.resume()

    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 200, (topic, 1): 100}, 60,
               what="the worker to carry on from the new log start")
    said = [line for line in w.log.splitlines() if "out of range" in line]
    assert len(said) == 1, said
    assert re.search(rf"ERROR .*{topic}\[0\]: offset 100 is out of range: the log now starts at 150 .*"
                     r"MESSAGES 100\.\.149 WERE NEVER PROCESSED \(50 skipped\).*continuing at 150", said[0]), said[0]
    moves = [h for h in history(pg_dsn, group) if "out of range" in h[4]]
    assert [(p, f, t) for p, f, t, _e, _r in moves] == [(0, 100, 150)], moves
    assert moves[0][3] > claimed[0] and epochs(pg_dsn, group)[0] == moves[0][3]  # a reset's epoch bump
    samples = scrape(port)
    assert total(samples, "kstore_position_resets_total", reason="below_log_start") == 1
    assert total(samples, "kstore_position_resets_total") == 1
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent | {m for m in later if m[2] >= 150})


def test_a_partition_waiting_for_its_claim_never_fails_the_worker(
        kafka: str, admin: Any, new_topic: Any, produce: Any, pg_dsn: str, workers: Any) -> None:
    """Without a reset policy, a partition assigned but not yet claimed (its claim waits for a
    locked table) has only kstore's placeholder position, below the log start here: paused, it is
    never fetched, so nothing raises; once claimed it starts at the log start, with no out-of-range."""
    topic = new_topic(2)
    group = f"g-{topic}"
    produce(topic, [f"a{i}" for i in range(50)], partition=0)
    kept = set(produce(topic, [f"b{i}" for i in range(50)], partition=1))
    admin.delete_records({TopicPartition(topic, 0): 30})
    engine = sa.create_engine(pg_dsn)
    conn = engine.connect()
    lock = conn.begin()
    conn.execute(sa.text("LOCK TABLE kstore_offsets IN ACCESS EXCLUSIVE MODE"))
    try:
        w = workers(pg_dsn, topic, group, env={"KSTORE_CLAIM_LOCK_TIMEOUT_MS": "300"})
        w.wait_for_log("could not claim", count=3)
        assert w.proc.poll() is None, w.log
    finally:
        lock.rollback()
        conn.close()
        engine.dispose()
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 50, (topic, 1): 50}, 60,
               what="both partitions processed once claimed")
    assert w.terminate() == 0
    assert "out of range" not in w.log and "Traceback" not in w.log
    assert_exactly_once(effects(pg_dsn), kept | {(topic, 0, o) for o in range(30, 50)})
