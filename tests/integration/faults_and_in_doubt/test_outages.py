"""Outages and slow handlers: broker restarts, a lost broker of three, handlers slower than max.poll.interval."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from kstore_devbroker.broker import Cluster
from tests.integration.operator_tools.test_top import Terminal
from tests.support.harness import assert_exactly_once, effects, wait_until


def test_handler_slower_than_max_poll_interval_is_not_evicted(pg_dsn: str, new_topic: Any, produce: Any,
                                                              workers: Any) -> None:
    """Batches of 8 s with max.poll.interval 7 s: the fetcher thread keeps polling, so the worker is not
    evicted and re-admitted in a loop, and each message lands once."""
    topic = new_topic(partitions=2)
    sent = set(produce(topic, (f"v{i}" for i in range(20))))
    w = workers(pg_dsn, topic, "slow", args=["--max-batch-size", "10"], env={
        "KSTORE_TEST_BATCH_SLEEP": "8", "KSTORE_MAX_POLL_INTERVAL_MS": "7000"})
    wait_until(lambda: len(effects(pg_dsn)) >= 20, 90, what="both slow batches")
    running = w.log  # (a worker leaving its group on the cooperative protocol says "revoked" as it stops)
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    # Evicted and re-admitted would show as revoked/lost partitions and a second claim.
    assert w.log.count("claimed ") == 1, f"the worker was evicted and re-admitted:\n{w.log}"
    assert "revoked" not in running and "lost" not in running and "fenced" not in w.log


@pytest.fixture
def own_cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cluster = Cluster(request.param, extra_config={"auto.create.topics.enable": "false"})
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _producer(cluster: Cluster) -> Any:
    return KafkaProducer(bootstrap_servers=cluster.bootstrap_servers, acks="all", retries=20, linger_ms=5,
                         request_timeout_ms=15000)


def _send(producer: Any, topic: str, prefix: str, n: int) -> set[tuple[str, int, int]]:
    futures = [producer.send(topic, f"{prefix}{i}".encode()) for i in range(n)]
    producer.flush()
    return {(m.topic, m.partition, m.offset) for m in (f.get(timeout=60) for f in futures)}


def hold_a_batch(pause: Path, dsn: str, sent: int) -> int:
    """Hold the worker's next batch before it writes (the Recorder's KSTORE_TEST_PAUSE_FILE) and
    return how many of the ``sent`` messages are unprocessed; fails if no batch comes (the backlog
    was drained already)."""
    pause.touch()
    wait_until(pause.with_name(pause.name + ".batch").exists, 30, what="a batch of the backlog held in flight")
    return sent - len(effects(dsn))


@pytest.mark.cluster
@pytest.mark.parametrize("own_cluster", [1], indirect=True)
def test_single_broker_restart_mid_run(own_cluster: Cluster, pg_dsn: str, workers: Any, tmp_path: Path) -> None:
    """The broker restarts while a batch is in flight and messages of the backlog are unprocessed:
    the worker carries on after it, and every message (those sent after the restart too) lands once.
    `kstore top` watches it: while the broker is down a line says so above the last table read, and
    once it answers again the line goes."""
    admin = KafkaAdminClient(bootstrap_servers=own_cluster.bootstrap_servers)
    admin.create_topics([NewTopic("restart", num_partitions=3, replication_factor=1)])
    admin.close()
    producer = _producer(own_cluster)
    sent = _send(producer, "restart", "a", 600)
    pause = tmp_path / "pause"
    w = workers(pg_dsn, "restart", "restart",
                env={"KSTORE_TEST_BATCH_SLEEP": "0.1", "KSTORE_TEST_PAUSE_FILE": str(pause)},
                args=["--bootstrap-servers", own_cluster.bootstrap_servers, "--max-batch-size", "20"])
    wait_until(lambda: len(effects(pg_dsn)) >= 100, 60)
    unprocessed = hold_a_batch(pause, pg_dsn, len(sent))
    top = Terminal(["--group", "restart", "--dsn", pg_dsn, "--bootstrap-servers", own_cluster.bootstrap_servers,
                    "--interval", "0.5"])
    try:
        top.wait_for(r"\nrestart +0 ", timeout=60)
        own_cluster.stop_node(0)
        down = top.wait_for(r"cannot read the Kafka brokers", timeout=90)
        assert re.search(r"cannot read the Kafka brokers.*\n(.*\n)*restart +0 ", down), down  # above the table
        own_cluster.start_node(0)
        wait_until(lambda: "cannot read" not in top.frame() and re.search(r"\nrestart +0 ", top.frame()), 90,
                   what="top's outage line gone once the broker answers")
    finally:
        top.close()
    assert len(sent) - len(effects(pg_dsn)) == unprocessed, "the restart came while these were unprocessed"
    pause.unlink()  # the held batch and the rest of the backlog go on after the restart
    sent |= _send(producer, "restart", "b", 600)
    producer.close()
    wait_until(lambda: len(effects(pg_dsn)) >= 1200, 120, what="all 1,200 effects after the restart")
    time.sleep(1)
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)


@pytest.mark.cluster
@pytest.mark.parametrize("own_cluster", [3], indirect=True)
def test_losing_one_broker_of_three_mid_run(own_cluster: Cluster, pg_dsn: str, workers: Any, tmp_path: Path) -> None:
    """The broker of three that coordinates the group (and leads some partitions) is killed while a
    batch is in flight and messages of the backlog are unprocessed. A second worker then joins and
    leaves, so the first claims partitions again with the broker down (the claim reads the log
    bounds of the brokers left), and every message (those sent with the broker down too) lands once."""
    admin = KafkaAdminClient(bootstrap_servers=own_cluster.bootstrap_servers)
    admin.create_topics([NewTopic("ha", num_partitions=6, replication_factor=3,
                                  topic_configs={"min.insync.replicas": "2"})])
    admin.close()
    producer = _producer(own_cluster)
    sent = _send(producer, "ha", "a", 900)
    pause = tmp_path / "pause"
    args = ["--bootstrap-servers", own_cluster.bootstrap_servers, "--max-batch-size", "20"]
    w = workers(pg_dsn, "ha", "ha", env={"KSTORE_TEST_BATCH_SLEEP": "0.1", "KSTORE_TEST_PAUSE_FILE": str(pause)},
                args=args)
    wait_until(lambda: len(effects(pg_dsn)) >= 150, 60)
    coordinator = _coordinator(own_cluster, "ha")
    hold_a_batch(pause, pg_dsn, len(sent))
    own_cluster.stop_node([n.node_id for n in own_cluster.nodes].index(coordinator), kill=True)
    pause.unlink()  # the held batch and the rest of the backlog go on with the broker down
    sent |= _send(producer, "ha", "b", 600)
    producer.close()
    claims = w.log.count("claimed ")
    w2 = workers(pg_dsn, "ha", "ha", env={"KSTORE_TEST_BATCH_SLEEP": "0.1"}, args=args)
    w2.wait_for_log("claimed ", 90)
    assert w2.terminate() == 0
    w.wait_for_log("claimed ", 90, count=claims + 1)  # what the second worker gave back
    wait_until(lambda: len(effects(pg_dsn)) >= 1500, 120, what="all 1,500 effects with a broker down")
    time.sleep(1)
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)


def _coordinator(cluster: Cluster, group: str) -> int:
    """The node id of the broker that coordinates ``group``."""
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    described = admin.describe_consumer_groups([group], request_timeout=30)[group].result(timeout=60)
    return int(described.coordinator.id)
