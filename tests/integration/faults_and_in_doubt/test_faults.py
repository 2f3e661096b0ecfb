"""Exactly-once under rebalances, kill -9, SIGSTOPped zombies and failing processors.

Every test runs real ``kstore worker`` processes against real Kafka and PostgreSQL.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.store import Store, make_engine
from tests.conftest import REBALANCE_PROTOCOLS
from tests.support.harness import (
    assert_claimed_before_committed,
    assert_exactly_once,
    effects,
    read_in_flight,
    stored_offsets,
    wait_until,
)

#: A worker's log line for each batch it committed.
COMMITTED = r"committed \d+ messages"


class BackgroundProducer:
    """Produces ``batch`` messages every ``interval`` seconds until stopped."""

    def __init__(self, produce: Any, topic: str, batch: int = 20, interval: float = 0.1) -> None:
        self.sent: set[tuple[str, int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(produce, topic, batch, interval), daemon=True)
        self._thread.start()

    def _run(self, produce: Any, topic: str, batch: int, interval: float) -> None:
        i = 0
        while not self._stop.is_set():
            self.sent.update(produce(topic, (f"m{i + j}" for j in range(batch))))
            i += batch
            time.sleep(interval)

    def stop(self) -> set[tuple[str, int, int]]:
        self._stop.set()
        self._thread.join(30)
        return self.sent


@pytest.mark.contract
def test_rebalance_one_two_three_and_back_to_one(pg_dsn: str, new_topic: Any, produce: Any, workers: Any,
                                                 rebalance_protocol: str) -> None:
    """6 partitions, messages produced throughout, 1 -> 2 -> 3 -> 1 workers, on each rebalance
    protocol: every effect exactly once, and no worker commits a partition before its claim. With
    the incremental ones (cooperative, consumer) a worker gives up only the partitions that move."""
    topic = new_topic(partitions=6)
    # A group of its own: under pytest-xdist the other clients' and protocols' runs may be in flight.
    group = f"reb-{topic}"
    producer = BackgroundProducer(produce, topic)
    env = {"KSTORE_TEST_BATCH_SLEEP": "0.02", "KSTORE_REBALANCE_PROTOCOL": rebalance_protocol}
    w1 = workers(pg_dsn, topic, group, env=env)
    # All six held before w2 joins: a consumer that first saw part of a new topic's metadata
    # claims part of it, then the rest in a rebalance of its own (a revoke before w2's join).
    wait_until(lambda: len(_claimed(w1.log, topic)) == 6, 60, what="w1 holding all 6 partitions")
    before_w2 = len(w1.log.splitlines())
    w2 = workers(pg_dsn, topic, group, env=env)
    w2.wait_for_log(r"claimed")
    w2.wait_for_log(COMMITTED)
    time.sleep(2)
    w3 = workers(pg_dsn, topic, group, env=env)
    w3.wait_for_log(r"claimed")
    w3.wait_for_log(COMMITTED)
    time.sleep(2)
    assert w3.terminate() == 0
    time.sleep(2)
    assert w2.terminate() == 0
    # 1 -> 2 -> 3 -> 2 -> 1: eager, w1 claims at each step; incremental, at least when it takes w2's.
    w1.wait_for_log(r"claimed", count=4 if rebalance_protocol == "eager" else 2)
    time.sleep(1)
    sent = producer.stop()
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what=f"{len(sent)} effects")
    time.sleep(1)
    assert w1.terminate() == 0
    counts = effects(pg_dsn)
    assert_exactly_once(counts, sent)
    # Each of the three workers really did part of the work (the Recorder writes its worker's name).
    by_worker = rows_by_worker(pg_dsn)
    assert set(by_worker) == {"w1", "w2", "w3"} and min(by_worker.values()) > 0, by_worker
    assert len(sent) > 500
    for w in (w1, w2, w3):
        assert assert_claimed_before_committed(w.log) > 0
    # w1's first revoke from w2's join on, against what w1 held just before it.
    held, revoked = _first_revoke(w1.log, topic, before_w2)
    assert revoked, w1.log[-3000:]
    if rebalance_protocol == "eager":
        assert revoked == held, (held, revoked)  # everything it held, at w2's join
    else:
        # At w2's join w1 gave up some of its partitions and kept delivering the others.
        assert revoked and revoked < held, (held, revoked)


def _first_revoke(log: str, topic: str, from_line: int) -> tuple[set[str], set[str]]:
    """The partitions of ``topic`` a worker held just before its first revoke at or after line
    ``from_line`` of its log, and those that revoke named (empty sets if none came)."""
    lines = log.splitlines()
    for at in range(from_line, len(lines)):
        if "kstore.engine.worker: revoked " in lines[at]:
            return (_claimed("\n".join(lines[:at]), topic),
                    set(re.findall(rf"{re.escape(topic)}\[(\d+)\]", lines[at])))
    return set(), set()


#: A worker's log line that drops partitions: revoked, lost, or fenced by a newer claim (which,
#: when the new owner claims before this worker's revoke is applied, comes first).
_DROPPED = re.compile(r"kstore\.engine\.worker: (?:revoked|lost|fenced) (?!on )")


def _claimed(log: str, topic: str) -> set[str]:
    """The partitions of ``topic`` a worker's log says it claimed (and has not since dropped)."""
    held: set[str] = set()
    for line in log.splitlines():
        if "kstore.engine.worker: claimed " in line:
            held |= set(re.findall(rf"{re.escape(topic)}\[(\d+)\]@", line))
        elif _DROPPED.search(line):
            held -= set(re.findall(rf"{re.escape(topic)}\[(\d+)\]", line))
    return held


def rows_by_worker(dsn: str) -> dict[str, int]:
    """How many effects rows each worker wrote (its KSTORE_TEST_WORKER_NAME, in the ``worker`` column)."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return {r[0]: r[1] for r in conn.execute(sa.text("SELECT worker, count(*) FROM effects GROUP BY worker"))}
    finally:
        engine.dispose()


def test_rebalance_while_the_fetch_queue_is_full(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """A slow worker on a backlog keeps its queue full, so its fetch thread only polls for
    liveness (one record per poll timeout). A second worker must still be given partitions
    promptly, and every effect lands once."""
    topic = new_topic(partitions=4)
    sent = set(produce(topic, (f"v{i}" for i in range(3000))))
    slow = {"KSTORE_TEST_BATCH_SLEEP": "0.2", "KSTORE_MAX_POLL_RECORDS": "50"}
    w1 = workers(pg_dsn, topic, "full", env=slow, args=["--max-batch-size", "50"])
    w1.wait_for_log(r"committed 50 messages", count=3)  # busy, with a full queue (at most 100 records)
    assert len(effects(pg_dsn)) < 1000
    started = time.monotonic()
    w2 = workers(pg_dsn, topic, "full", env=slow, args=["--max-batch-size", "50"])
    w2.wait_for_log(r"claimed", timeout=120)
    joined = time.monotonic() - started
    w2.wait_for_log(r"committed \d+ messages", timeout=60)
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 90, what=f"{len(sent)} effects")
    assert w1.terminate() == 0 and w2.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    # A fetch thread that stopped polling would hold the rebalance until its max.poll.interval (300 s).
    assert joined < 60, f"the second worker waited {joined:.1f} s for partitions"


@pytest.mark.parametrize(("per_message", "protocol"), [
    pytest.param(False, "eager", id="executemany"), pytest.param(True, "eager", id="deferred-per-message"),
    *(pytest.param(False, p, id=f"executemany-{p}") for p in REBALANCE_PROTOCOLS if p != "eager")])
def test_kill_9_between_processor_write_and_commit(pg_dsn: str, new_topic: Any, produce: Any, workers: Any,
                                                   tmp_path: Path, per_message: bool, protocol: str) -> None:
    """Killed after the batch's effects reached the database, before COMMIT; also with one
    deferred INSERT per message, sent by the processor's flush just before the kill; and on each
    incremental rebalance protocol, where the next worker gets the dead one's partitions only once
    its session has timed out."""
    topic = new_topic(partitions=2)
    # A group of its own: under pytest-xdist the other clients' and protocols' runs may be in flight.
    group = f"crash-{protocol}-{int(per_message)}"
    sent = set(produce(topic, (f"v{i}" for i in range(400))))
    hang = tmp_path / "hang"
    w1 = workers(pg_dsn, topic, group, env={"KSTORE_TEST_HANG_AT": "100", "KSTORE_TEST_HANG_FILE": str(hang),
                                             "KSTORE_TEST_PER_MESSAGE": "1" if per_message else "0",
                                             "KSTORE_REBALANCE_PROTOCOL": protocol},
                 args=["--max-batch-size", "25"])
    wait_until(hang.exists, 60, what="the processor to write its batch and hang")
    in_flight = read_in_flight(hang)
    assert len(in_flight) == 25
    # The batch's rows are on the server, in the worker's open transaction, before the kill.
    xid, rows = uncommitted_effects(pg_dsn)
    assert rows == {(p, o) for _, p, o in in_flight}, f"the open transaction {xid} holds {sorted(rows)}"
    w1.kill()
    wait_until(lambda: transaction_status(pg_dsn, xid) == "aborted", 30, what=f"transaction {xid} rolled back")

    before = effects(pg_dsn)
    assert not in_flight & set(before), "effects of the uncommitted batch survived kill -9"
    stored = stored_offsets(pg_dsn, group)
    for t, p, o in in_flight:
        assert stored[(t, p)] <= o, "offsets moved past a batch that never committed"

    w2 = workers(pg_dsn, topic, group, env={"KSTORE_REBALANCE_PROTOCOL": protocol})
    wait_until(lambda: len(effects(pg_dsn)) >= 400, 60, what="all 400 effects after restart")
    assert w2.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    assert assert_claimed_before_committed(w2.log) > 0


def uncommitted_effects(dsn: str) -> tuple[int, set[tuple[int, int]]]:
    """The one open transaction that has written effects (a worker's batch) and the (partition,
    offset) of the rows it inserted, read from the table's pages (pageinspect): rows no other
    transaction can see until it commits. Other transactions may be open meanwhile (a relay's
    heartbeat), so the worker's is the one whose xid stamped effects rows."""
    engine = sa.create_engine(dsn)
    found: dict[int, list[Any]] = {}
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pageinspect"))
            xids = conn.execute(sa.text(
                "SELECT backend_xid::text::bigint FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()"
            )).scalars().all()
            for xid in xids:
                attrs = conn.execute(sa.text(
                    "SELECT t_attrs[3], t_attrs[4] FROM generate_series(0, pg_relation_size('effects') / "
                    "current_setting('block_size')::int - 1) AS page, "
                    "LATERAL heap_page_item_attrs(get_raw_page('effects', page::int), 'effects'::regclass) "
                    "WHERE t_xmin::text::bigint = :xid"), {"xid": xid}).all()
                if attrs:
                    found[xid] = attrs
    finally:
        engine.dispose()
    [(xid, attrs)] = found.items()
    # partition_id (int4) and kafka_offset (int8), as stored: in this machine's byte order
    return xid, {(int.from_bytes(p, sys.byteorder), int.from_bytes(o, sys.byteorder)) for p, o in attrs}


def transaction_status(dsn: str, xid: int) -> str:
    """'in progress', 'committed' or 'aborted' (a fresh test cluster: the xid's epoch is 0)."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return str(conn.execute(sa.text("SELECT txid_status(:x)"), {"x": xid}).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.contract
def test_sigstopped_zombie_is_fenced(pg_dsn: str, new_topic: Any, produce: Any, workers: Any,
                                     tmp_path: Path, rebalance_protocol: str) -> None:
    """A worker paused mid-batch loses its partitions; when it wakes, its commit is fenced (on each
    rebalance protocol)."""
    topic = new_topic(partitions=2)
    # A group of its own: under pytest-xdist the other clients' and protocols' runs may be in flight.
    group = f"zombie-{topic}"
    sent = set(produce(topic, (f"v{i}" for i in range(300))))
    hang = tmp_path / "hang"
    protocol = {"KSTORE_REBALANCE_PROTOCOL": rebalance_protocol}
    zombie = workers(pg_dsn, topic, group, args=["--max-batch-size", "20"], env={
        "KSTORE_TEST_HANG_AT": "60", "KSTORE_TEST_HANG_FILE": str(hang), "KSTORE_TEST_HANG_SECONDS": "2",
        # Let the zombie's transaction survive the pause, so it is the epoch that stops it.
        "KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": "600000", **protocol,
    })
    wait_until(hang.exists, 60, interval=0.01, what="the zombie to be mid-batch")
    zombie.pause()
    in_flight = read_in_flight(hang)
    assert in_flight, "the zombie's batch"

    healthy = workers(pg_dsn, topic, group, env=protocol)
    wait_until(lambda: len(effects(pg_dsn)) >= 300, 90, what="the healthy worker to process everything")
    zombie.resume()
    # The zombie wakes inside its batch and tries to commit; give it time to do so.
    wait_until(lambda: "fenced on" in zombie.log or "committed 20 messages" in zombie.log, 30,
               what="the zombie's commit attempt")
    time.sleep(2)
    assert_exactly_once(effects(pg_dsn), sent)
    assert healthy.terminate() == 0
    assert zombie.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    assert "fenced on" in zombie.log and "rolled back" in zombie.log
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT topic, partition_id, kafka_offset, worker FROM effects")).all()
    engine.dispose()
    by = {(r[0], r[1], r[2]): r[3] for r in rows}
    assert all(by[m] == "w2" for m in in_flight), "the zombie's in-flight batch must not have landed"
    assert assert_claimed_before_committed(healthy.log) > 0
    assert_claimed_before_committed(zombie.log)


@pytest.mark.contract
def test_a_partition_fenced_by_a_zombies_late_claim_is_claimed_again_a_session_timeout_later(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, rebalance_protocol: str) -> None:
    """A zombie that wakes and claims a partition Kafka has given to a live worker fences that
    worker, which drops it. No rebalance follows (the zombie is no member any more; with the
    incremental protocols nothing would re-offer a kept partition anyway): the live worker, still
    assigned it, claims it again once a session timeout has passed, and carries on exactly once.
    The zombie's claim is made here by the test, as the zombie's claim transaction makes it."""
    topic = new_topic(partitions=2)
    # A group of its own: under pytest-xdist the other clients' and protocols' runs may be in flight.
    group = f"orphan-{topic}"
    producer = BackgroundProducer(produce, topic, batch=5, interval=0.1)
    w = workers(pg_dsn, topic, group, env={"KSTORE_REBALANCE_PROTOCOL": rebalance_protocol})
    w.wait_for_log(rf"claimed {topic}\[0\]@\d+, {topic}\[1\]@")
    w.wait_for_log(COMMITTED)
    settings = Settings(dsn=pg_dsn)
    store = Store(make_engine(settings), settings)
    try:
        with store.claiming(group, [(topic, 0)], "a-zombie") as (_conn, claims):
            assert claims[(topic, 0)].epoch >= 2
    finally:
        store.engine.dispose()
    w.wait_for_log(rf"fenced on {topic}\[0\]: another worker claimed them", timeout=60)
    w.wait_for_log(rf"{topic}\[0\] still assigned here a session timeout after being fenced: claiming again",
                   timeout=60)
    w.wait_for_log(rf"claimed {topic}\[0\]@", count=2, timeout=60)
    time.sleep(1)
    sent = producer.stop()
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what=f"{len(sent)} effects")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    assert assert_claimed_before_committed(w.log) > 0
    assert stored_offsets(pg_dsn, group)[(topic, 0)] == 1 + max(o for _, p, o in sent if p == 0)


def test_processor_exception_rolls_back_the_batch_then_stops_before_the_bad_message(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """The failing batch (30-39) rolls back whole; its good messages then commit one by one, the bad one
    (35) is retried and, with on_error=stop, the worker stops with the offset still before it."""
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(100)))
    w = workers(pg_dsn, topic, "boom", env={"KSTORE_TEST_FAIL_AT": "35"},
                args=["--max-batch-size", "10", "--on-error", "stop", "--max-attempts", "2"])
    code = w.wait(60)
    assert code == 1
    last = w.log.strip().splitlines()[-1]
    assert last.startswith("kstore: error: processor Recorder failed on ") and "offset 35 after 2 attempt(s)" in last
    assert "ValueError: cannot handle offset 35" in last and "on_error=stop" in last
    assert "Traceback" not in w.log
    assert "a batch of 10 failed" in w.log
    assert stored_offsets(pg_dsn, "boom") == {(topic, 0): 35}
    # 30..34 were written by the failed batch too: had it not rolled back, they would be there twice.
    assert_exactly_once(effects(pg_dsn), {(topic, 0, o) for o in range(35)})


def test_sqlite_default_single_worker_end_to_end(sqlite_dsn: str, new_topic: Any, produce: Any,
                                                 workers: Any) -> None:
    topic = new_topic(partitions=3)
    sent = set(produce(topic, (f"v{i}" for i in range(300))))
    w = workers(sqlite_dsn, topic, "lite")
    wait_until(lambda: len(effects(sqlite_dsn)) >= 300, 60, what="300 effects in SQLite")
    more = set(produce(topic, (f"w{i}" for i in range(30))))
    wait_until(lambda: len(effects(sqlite_dsn)) >= 330, 60)
    assert w.terminate() == 0
    assert_exactly_once(effects(sqlite_dsn), sent | more)
    assert sum(v or 0 for v in stored_offsets(sqlite_dsn, "lite").values()) == 330
