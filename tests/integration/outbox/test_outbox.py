"""Kafka -> database -> Kafka, exactly once: ``Processor.produce`` through the outbox and its relay.

Real ``kstore worker`` and ``kstore relay`` processes, a real broker and a real PostgreSQL (or
SQLite). A ``read_committed`` reader of the output topic must see every expected record once,
and per key in the order the batches committed (tests/support/outbox_processors.py says how that is told).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from sqlalchemy.engine import make_url

from kstore import Settings
from kstore.kafka.clients import admin_reader
from kstore.relay.departures import settled_members
from kstore_devbroker.broker import Cluster
from tests.conftest import KAFKA_CLIENT, TEST_SESSION_TIMEOUT_MS
from tests.integration.telemetry.test_metrics import get, port_of, scrape, total
from tests.support.faultproxy import FaultProxy
from tests.support.harness import SUPPORT_DIR, WorkerProcess, outbox_rows, read_committed, stored_offsets, wait_until
from tests.support.outbox_processors import check_outputs, metadata

BOOKER = "outbox_processors:Booker"


def keyed_values(count: int, keys: int, start: int = 0) -> list[str]:
    return [f"k{(start + i) * 7919 % keys}:{start + i}" for i in range(count)]


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
    env = {"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_TEST_BATCH_SLEEP": "0.01", "KSTORE_OUTBOX_SHARDS": "4"}
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


@pytest.mark.parametrize("how", ["stopped", "killed", "paused"])
def test_a_gone_workers_shards_are_taken_once_it_left_the_group_not_when_its_lease_ends(
        how: str, pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """A worker stopped (SIGTERM), SIGKILLed or SIGSTOPped while its relay holds every shard: once
    Kafka has seen it leave (at once, or after the session timeout, 6 s here) the other worker's
    relay takes the shards, long before their lease (300 s here) would have run out, or its next
    heartbeat (100 s). A paused one woken afterwards publishes nothing (its producers were fenced):
    every record once, per key in commit order."""
    source, out = new_topic(partitions=2), new_topic(partitions=2)
    booker_tables(pg_dsn)
    env = {"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_OUTBOX_SHARDS": "2", "KSTORE_OUTBOX_LEASE_S": "300"}
    sent = produce(source, keyed_values(200, keys=10))
    w1 = workers(pg_dsn, source, "booker", BOOKER, env=env)
    w1.wait_for_log(r"outbox relay \S+ publishes shard 1 of group 'booker'", timeout=90)
    w2 = workers(pg_dsn, source, "booker", BOOKER, env=env)
    # Both in the group, settled: w1's leaving is a rebalance that w2 sees.
    reader = admin_reader(Settings(bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT))
    try:
        wait_until(lambda: len(settled_members(reader, "booker") or ()) == 2, 90, what="two settled members")
    finally:
        reader.close()
    {"stopped": w1.terminate, "killed": w1.kill, "paused": w1.pause}[how]()
    sent += produce(source, keyed_values(200, keys=10, start=200))
    # Well under the lease: only a relay that took the shards early publishes the second half in time.
    wait_done(pg_dsn, "booker", sent, timeout=80)
    if how != "stopped":  # a stopped worker's relay released its shards itself
        w2.wait_for_log(r"outbox shard\(s\) [0-9, ]+ of group 'booker': their relay's worker left the group",
                        timeout=5)
    if how == "paused":
        w1.resume()
        sent += produce(source, keyed_values(200, keys=10, start=400))
        wait_done(pg_dsn, "booker", sent, timeout=120)
        assert w1.terminate() == 0
    check_outputs(read_committed(kafka, out), sent)
    assert w2.terminate() == 0


def test_sqlite_one_worker_publishes_once_across_a_kill(
        sqlite_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """The embedded default: one worker on SQLite, 20,000 messages, SIGKILLed while publishing, then started again."""
    source, out = new_topic(partitions=2), new_topic(partitions=2)
    booker_tables(sqlite_dsn)
    env = {"KSTORE_TEST_OUT_TOPIC": out}
    sent = produce(source, keyed_values(20_000, keys=25))
    w1 = workers(sqlite_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "200"])
    w1.wait_for_log(r"outbox shard \d+ of group 'booker': published up to", timeout=90)
    time.sleep(0.5)
    w1.kill()
    w2 = workers(sqlite_dsn, source, "booker", BOOKER, env=env, args=["--max-batch-size", "200"])
    wait_done(sqlite_dsn, "booker", sent)
    check_outputs(read_committed(kafka, out), sent)
    # w1 may have processed everything before its kill: the stop is asked of a w2 that is running.
    w2.wait_for_log(r"claimed ", timeout=90)
    assert w2.terminate() == 0


def test_standalone_relays_killed_and_paused_publish_nothing_twice(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, relays: Any, kafka: str) -> None:
    """Workers with --no-relay, publishing by standalone relays: one relay is SIGKILLed mid-publish,
    another SIGSTOPped (a zombie holding its shards and an open Kafka transaction); the relays
    that take their shards over fence them in the database and in Kafka. The zombie, woken,
    publishes nothing: every record once, in commit order."""
    source, out = new_topic(partitions=4), new_topic(partitions=3)
    booker_tables(pg_dsn)
    env = {"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_OUTBOX_LEASE_S": "4", "KSTORE_OUTBOX_SHARDS": "4"}
    relay_env = {"KSTORE_OUTBOX_LEASE_S": "4", "KSTORE_OUTBOX_SHARDS": "4"}
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


@pytest.fixture
def outbox_cluster() -> Iterator[Cluster]:
    """A broker of this test's own: it is restarted mid-run."""
    cluster = Cluster(1, extra_config={"auto.create.topics.enable": "false"})
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def pg_proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    url = make_url(pg_dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy


@pytest.mark.long
def test_exactly_once_to_kafka_through_kills_a_zombie_relay_cut_commits_and_a_broker_restart(
        outbox_cluster: Cluster, pg_dsn: str, pg_proxy: FaultProxy, tmp_path: Path) -> None:
    """20,000 input messages on 6 partitions, each producing one or two keyed records (50 keys,
    spread over every partition), through: COMMIT answers cut by the fault proxy (batches' and
    relays' alike), a worker SIGKILLed while its relay publishes, a standalone relay SIGKILLed
    mid-publish, another SIGSTOPped while it holds shards (a zombie, woken at the end), and a
    broker restart; the relay of a worker that was there throughout publishes on. A read_committed
    reader sees every expected record once, per key in commit order, and the outbox empties."""
    kafka = outbox_cluster.bootstrap_servers
    admin = KafkaAdminClient(bootstrap_servers=kafka)
    admin.create_topics([NewTopic("payments", 6, 1), NewTopic("booked", 3, 1)])
    admin.close()
    booker_tables(pg_dsn)
    producer = KafkaProducer(bootstrap_servers=kafka, acks="all", linger_ms=5, retries=20)

    def send(start: int, count: int) -> list[tuple[str, int, int]]:
        futures = [producer.send("payments", v.encode()) for v in keyed_values(count, keys=50, start=start)]
        producer.flush()
        return [(m.topic, m.partition, m.offset) for m in (f.get(timeout=60) for f in futures)]

    env = {"KSTORE_TEST_OUT_TOPIC": "booked", "KSTORE_OUTBOX_LEASE_S": "4", "KSTORE_OUTBOX_SHARDS": "4",
           "KSTORE_SESSION_TIMEOUT_MS": str(TEST_SESSION_TIMEOUT_MS), "KSTORE_HEARTBEAT_INTERVAL_MS": "1000"}
    started: list[WorkerProcess] = []

    def start(name: str, *args: str) -> WorkerProcess:
        proc = WorkerProcess(["--log-level", "DEBUG", *args, "--bootstrap-servers", kafka], env,
                             tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    def worker(name: str, dsn: str, *args: str) -> WorkerProcess:
        return start(name, "worker", BOOKER, "--dsn", dsn, "--group", "booker", "--topic", "payments",
                     "--max-batch-size", "200", *args)

    def relay(name: str) -> WorkerProcess:
        return start(name, "relay", "--dsn", pg_dsn, "--group", "booker")

    try:
        sent = send(0, 10_000)
        w1 = worker("w1", pg_proxy.dsn_through(pg_dsn))
        w2 = worker("w2", pg_dsn)
        r1 = relay("r1")
        w1.wait_for_log(r"claimed", timeout=90)
        for n in range(1, 4):
            pg_proxy.cut_after_commit()
            wait_until(lambda n=n: pg_proxy.commits_cut >= n, 90, what=f"COMMIT answer cut {n}")
        w1.wait_for_log(r"published up to", timeout=90)
        w1.kill()  # mid-run, its relay thread with it
        r1.wait_for_log(r"outbox relay \S+ publishes shard", timeout=60)
        r1.kill()
        r2 = relay("r2")
        r2.wait_for_log(r"outbox relay \S+ publishes shard", timeout=60)
        r2.pause()  # a zombie holding its shards' leases (and perhaps an open Kafka transaction)
        w3 = worker("w3", pg_dsn, "--no-relay")
        sent += send(10_000, 5_000)
        w3.wait_for_log(r"claimed", timeout=60)
        outbox_cluster.stop_node(0)
        time.sleep(2)  # producers and consumers meet the outage
        outbox_cluster.start_node(0)
        sent += send(15_000, 5_000)
        wait_done(pg_dsn, "booker", sent, timeout=300)
        r2.resume()
        r2.wait_for_log(r"taken by another relay|another relay's producer took over", timeout=60)
        time.sleep(2)  # whatever the zombie still tries, it tries now
        assert outbox_rows(pg_dsn) == 0
        check_outputs(read_committed(kafka, "booked"), sent)
        assert len(sent) == 20_000
        for proc in (w2, w3, r2):
            assert proc.terminate() == 0
    finally:
        producer.close()
        for proc in started:
            proc.cleanup()


def test_records_that_could_never_be_published_dead_letter_their_message_alone(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """A partition the output topic lacks, a record over the size limit, a value that is not JSON: each
    fails at produce(), its message is dead-lettered (on_error="dead_letter"), nothing of it is published,
    and every other message's record is published once; the relay is never stopped by them. (A topic the
    cluster lacks is an outage instead: tests/integration/outbox/test_output_topics.py.)"""
    source, out = new_topic(partitions=1), new_topic(partitions=1)
    bad = {"no-partition": "has 1 partition(s)", "huge": "over outbox_max_record_bytes",
           "unjson": "cannot serialize"}
    values = [f"ok{i}" for i in range(30)]
    for i, value in enumerate(bad):
        values.insert(7 + 9 * i, value)
    sent = produce(source, values)
    w = workers(pg_dsn, source, "picky", "outbox_processors:Picky", env={"KSTORE_TEST_OUT_TOPIC": out})
    wait_done(pg_dsn, "picky", sent)
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        letters = {bytes(row.value).decode(): row.error for row in conn.execute(
            sa.text("SELECT value, error FROM kstore_dead_letters WHERE consumer_group = 'picky'"))}
    engine.dispose()
    assert set(letters) == set(bad)
    for value, reason in bad.items():
        assert reason in letters[value] and "ProduceError" in letters[value], letters[value]
    assert sorted(v for _, v in read_committed(kafka, out)) == sorted(f"ok{i}".encode() for i in range(30))
    assert "stopped on row" not in w.log
    assert w.terminate() == 0

    # Replayed unedited, the letter for the partition the topic lacks fails again at produce(): the
    # replay asks the brokers it is given, as the worker does, and nothing goes to the outbox.
    with engine.connect() as conn:
        nowhere = conn.execute(sa.text("SELECT id FROM kstore_dead_letters WHERE consumer_group = 'picky' "
                                       "AND value = :v"), {"v": b"no-partition"}).scalar_one()
    env = {k: v for k, v in os.environ.items() if k != "KSTORE_BOOTSTRAP_SERVERS"}
    r = subprocess.run([sys.executable, "-m", "kstore", "dead-letters", "replay", "outbox_processors:Picky",
                        "--group", "picky", "--id", str(nowhere), "--dsn", pg_dsn, "--bootstrap-servers", kafka],
                       capture_output=True, text=True, cwd=SUPPORT_DIR, timeout=120,
                       env={**env, "KSTORE_TEST_OUT_TOPIC": out})
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"dead letter {nowhere} failed again" in r.stderr and "has 1 partition(s)" in r.stderr, r.stderr
    assert outbox_rows(pg_dsn) == 0
    engine.dispose()


def test_the_worker_stops_taking_batches_while_too_many_records_wait(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, relays: Any, kafka: str) -> None:
    """Backpressure: with no relay running, a worker processes until more than outbox_max_pending
    records wait, then takes no more batches (and says why); a relay drains them and it goes on."""
    source, out = new_topic(partitions=1), new_topic(partitions=1)
    booker_tables(pg_dsn)
    sent = produce(source, keyed_values(2000, keys=10))
    w = workers(pg_dsn, source, "booker", BOOKER, args=["--max-batch-size", "50", "--no-relay"],
                env={"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_OUTBOX_MAX_PENDING": "300"})
    w.wait_for_log(r"wait to be published \(outbox_max_pending=300\): processing paused", timeout=90)
    time.sleep(2)  # were it not paused, it would go on committing now
    waiting = outbox_rows(pg_dsn)
    assert 300 < waiting < 300 + 2 * 50 * 2, waiting  # at most the batch that crossed the bound, and the next
    assert (stored_offsets(pg_dsn, "booker").get((source, 0)) or 0) < 2000
    r = relays(pg_dsn, "booker", env={"KSTORE_METRICS_PORT": "0", "KSTORE_METRICS_HOST": "127.0.0.1"})
    wait_done(pg_dsn, "booker", sent)
    assert "processing again" in w.log
    published = read_committed(kafka, out)
    check_outputs(published, sent)
    # The standalone relay serves its own metrics and probes: every record was its to publish.
    port = port_of(r)
    wait_until(lambda: total(scrape(port), "kstore_outbox_published_total", group="booker") == len(published), 30,
               what="the relay's published count to reach what Kafka holds")
    assert get(port, "/livez")[0] == 200
    assert get(port, "/readyz") == (200, "ok: 1 of 1 shard(s) held here\n")
    assert w.terminate() == 0 and r.terminate() == 0
