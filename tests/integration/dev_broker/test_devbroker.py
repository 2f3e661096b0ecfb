"""The development broker runs a real Kafka: topics, produce, consume, replication, restarts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic

from kstore_devbroker.broker import Broker, Cluster

REPO = Path(__file__).resolve().parents[3]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _create_topic(bootstrap: str, topic: str, partitions: int, rf: int, **configs: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, partitions, rf, topic_configs=configs)], wait_for_metadata=True)
    finally:
        admin.close()


def _describe(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        (described,) = admin.describe_topics([topic])
    finally:
        admin.close()
    partitions: list[dict[str, Any]] = described["partitions"]
    return partitions


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for value in values:
            producer.send(topic, value).get(timeout=30)
    finally:
        producer.close()


def _consume(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"g-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=20000,
    )
    try:
        values = []
        for record in consumer:
            values.append(record.value)
            if len(values) == count:
                break
        return values
    finally:
        consumer.close(autocommit=False)


def test_single_broker_produce_consume() -> None:
    with Broker() as broker:
        port = broker.port
        data_dir = broker.data_dir
        assert broker.bootstrap_servers == f"127.0.0.1:{port}"
        _create_topic(broker.bootstrap_servers, "devbroker-single", 1, 1)
        _produce(broker.bootstrap_servers, "devbroker-single", [b"hello"])
        assert _consume(broker.bootstrap_servers, "devbroker-single", 1) == [b"hello"]
        assert "Kafka Server started" in broker.nodes[0].log_file.read_text()
    assert not _port_open(port)
    assert not data_dir.exists()  # a temporary data dir is removed on stop


def _wait_for_isr(bootstrap: str, topic: str, size: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        isr = [sorted(p["isr_nodes"]) for p in _describe(bootstrap, topic)]
        if all(len(nodes) == size for nodes in isr):
            return
        assert time.monotonic() < deadline, f"ISR {isr} never reached {size}"
        time.sleep(0.5)


@pytest.mark.cluster
def test_three_node_cluster_survives_a_stopped_node() -> None:
    topic = "devbroker-replicated"
    with Cluster(n_brokers=3) as cluster:
        bootstrap = cluster.bootstrap_servers
        assert len(bootstrap.split(",")) == 3
        # min.insync.replicas=2 makes acks=all mean something once one node is down.
        _create_topic(bootstrap, topic, 3, 3, **{"min.insync.replicas": "2"})
        for partition in _describe(bootstrap, topic):
            assert sorted(partition["replica_nodes"]) == [1, 2, 3]
            assert sorted(partition["isr_nodes"]) == [1, 2, 3]
        _produce(bootstrap, topic, [b"before"])

        # A clean stop, then a restart on the same port with its data: it catches up and
        # rejoins every ISR.
        port = cluster.nodes[0].port
        cluster.stop_node(0)
        assert not _port_open(port)
        _produce(bootstrap, topic, [b"while-stopped"])
        cluster.start_node(0)
        assert cluster.nodes[0].port == port and _port_open(port)
        _wait_for_isr(bootstrap, topic, 3)

        # A crash (SIGKILL): leadership moves once the controller fences the dead node.
        cluster.stop_node(1, kill=True)
        _produce(bootstrap, topic, [b"after-crash"])
        cluster.start_node(1)
        _wait_for_isr(bootstrap, topic, 3)

        values = _consume(bootstrap, topic, 3)
        assert sorted(values) == [b"after-crash", b"before", b"while-stopped"]
    for node in cluster.nodes:
        assert not _port_open(node.port)


def test_cli_start_and_stop(tmp_path: Path) -> None:
    state_file = tmp_path / "broker.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    cli = [sys.executable, "-m", "kstore_devbroker"]
    # capture_output: the command must return although the broker keeps running, so the
    # JVM must not hold our stdout pipe open.
    started = subprocess.run(
        [*cli, "start", "--state-file", str(state_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    state = json.loads(state_file.read_text())
    try:
        assert started.stdout.strip() == state["bootstrap_servers"]
        assert f"export KSTORE_BOOTSTRAP_SERVERS={state['bootstrap_servers']}" in started.stderr
        _create_topic(state["bootstrap_servers"], "devbroker-cli", 1, 1)
    finally:
        subprocess.run([*cli, "stop", "--state-file", str(state_file)], env=env, timeout=60, check=True)
    (node,) = state["nodes"]
    assert not _port_open(node["port"])
    assert not Path(f"/proc/{node['pid']}").exists() or "Z" in _proc_state(node["pid"])
    assert not state_file.exists()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_port_taken_before_kafka_binds_it_is_replaced(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The ports are picked free, then released for Kafka to bind: another process may take one
    in between (on a shared machine, another test run). The node then fails to bind, and the
    broker is started again on other ports instead of failing the test session."""
    import kstore_devbroker.broker as devbroker

    real = devbroker._free_ports
    picked: list[list[int]] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        def first_one_taken(count: int) -> list[int]:
            ports = real(count)
            if not picked:
                ports[0] = taken.getsockname()[1]  # the broker's own port, held by someone else
            picked.append(ports)
            return ports

        monkeypatch.setattr(devbroker, "_free_ports", first_one_taken)
        with Broker() as broker:
            assert len(picked) == 2
            assert broker.nodes[0].port == picked[1][0] != taken.getsockname()[1]
            _create_topic(broker.bootstrap_servers, "after-a-taken-port", 1, 1)
            assert len(_describe(broker.bootstrap_servers, "after-a-taken-port")) == 1  # it serves
    assert "taken before it could bind it" in caplog.text

