"""``kstore relay`` on its own, as an operator runs it: it says on stderr when a stop signal reaches
it, as ``kstore worker`` does, and exits 0 after the records it took are published; nothing is said
at WARNING on its start, on a broker just started included (librdkafka's lines and the relay's own);
its /metrics shows its outbox's backlog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from sqlalchemy.orm import Session

from kstore import Settings
from kstore.outbox import Outbox
from kstore_devbroker.broker import Cluster
from tests.conftest import BROKER_CONFIG, _has_leaders
from tests.integration.telemetry.test_metrics import port_of, scrape
from tests.support.harness import SUPPORT_DIR, WorkerProcess, outbox_rows, read_committed, wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_the_relay_logs_its_stop_and_exits_0(signum: signal.Signals, sqlite_dsn: str, kafka: str, new_topic: Any,
                                             tmp_path: Path) -> None:
    topic = new_topic(partitions=1)
    engine = sa.create_engine(sqlite_dsn)
    events = Outbox("relay-stop", Settings(dsn=sqlite_dsn), shards=1)
    events.setup(engine)
    with Session(engine) as session, session.begin():
        events.produce(session, topic, "placed", key="c-1")
    engine.dispose()
    err = tmp_path / "stderr.log"
    with err.open("wb") as stderr:
        relay = subprocess.Popen([sys.executable, "-m", "kstore", "relay", "--outbox", "relay-stop", "--dsn",
                                  sqlite_dsn, "--bootstrap-servers", kafka], cwd=SUPPORT_DIR, stdout=subprocess.PIPE,
                                 stderr=stderr, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})
    try:
        wait_until(lambda: read_committed(kafka, topic, 1), 60, what=f"the record on {topic}")
        wait_until(lambda: outbox_rows(sqlite_dsn) == 0, 30, what="the outbox drained")
        relay.send_signal(signum)
        code = relay.wait(60)
    finally:
        if relay.poll() is None:
            relay.kill()
    out, log = relay.stdout.read().decode() if relay.stdout else "", err.read_text()
    assert code == 0, log
    stops = [line.split(" ", 2)[2] for line in log.splitlines() if " received: " in line]  # past the time
    assert stops == [f"INFO kstore.cli: {signum.name} received: finishing the transactions in flight, then giving "
                     "the outbox's shards up"], log
    assert " received: " not in out
    # librdkafka's lines and the relay's own: a transactional producer's first start on a broker meets a
    # coordinator still loading, which is retried (tests/unit/kafka/test_librdkafka_log_levels.py).
    assert not [line for line in log.splitlines() if " WARNING " in line], log


def test_a_relay_on_a_broker_just_started_says_no_warning_while_its_coordinators_load(
        sqlite_dsn: str, tmp_path: Path) -> None:
    """A broker started a moment ago answers the relay's first questions "not now" (its coordinators
    still loading): routine, retried, said at INFO; the record goes out, and no line is a WARNING."""
    engine = sa.create_engine(sqlite_dsn)
    events = Outbox("fresh-start", Settings(dsn=sqlite_dsn), shards=2)
    events.setup(engine)
    with Cluster(1, extra_config=BROKER_CONFIG) as fresh:
        kafka = fresh.bootstrap_servers
        admin = KafkaAdminClient(bootstrap_servers=kafka)
        try:
            admin.create_topics([NewTopic("placed", num_partitions=1, replication_factor=1)])
            wait_until(lambda: _has_leaders(admin, "placed", 1), 30, what="the topic's leaders")
        finally:
            admin.close()
        with Session(engine) as session, session.begin():
            for n in range(4):
                events.produce(session, "placed", f"order {n}", key=f"c-{n}")
        relay = WorkerProcess(["relay", "--outbox", "fresh-start", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka],
                              {}, tmp_path / "relay.log")
        try:
            wait_until(lambda: len(read_committed(kafka, "placed", 10)) == 4, 90, what="the records on 'placed'")
            wait_until(lambda: outbox_rows(sqlite_dsn) == 0, 30, what="the outbox drained")
            assert relay.terminate() == 0, relay.log
        finally:
            relay.cleanup()
    engine.dispose()
    assert not [line for line in relay.log.splitlines() if " WARNING " in line], relay.log


def test_a_standalone_relay_exposes_its_outboxs_backlog_until_it_has_published_it(
        pg_dsn: str, kafka: str, admin: Any, tmp_path: Path) -> None:
    """Its records waiting and the oldest's age on its /metrics while Kafka refuses the first record (a topic
    that takes none so large: the rows wait, nothing is skipped); 0 once the topic takes it and all is out."""
    out = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(out, num_partitions=1, replication_factor=1,
                                  topic_configs={"max.message.bytes": "2000"})])
    engine = sa.create_engine(pg_dsn)
    events = Outbox("gauged", Settings(dsn=pg_dsn), shards=1)
    written = time.time()
    with Session(engine) as session, session.begin():
        events.produce(session, out, b"x" * 5000, key="k")
        events.produce(session, out, "after", key="k")
    with Session(engine) as session, session.begin():
        events.produce(session, out, "later", key="k")
    engine.dispose()
    relay = WorkerProcess(["relay", "--outbox", "gauged", "--dsn", pg_dsn, "--bootstrap-servers", kafka,
                           "--metrics-port", "0", "--metrics-host", "127.0.0.1"], {}, tmp_path / "relay.log")
    try:
        port = port_of(relay)
        relay.wait_for_log(r"outbox shard 0 of group 'gauged' stopped on row 1: Kafka refused it", timeout=90)
        seen = scrape(port)
        scraped = time.time()
        assert seen[("kstore_outbox_records_waiting", frozenset({("outbox", "gauged")}))] == 3
        age = seen[("kstore_outbox_oldest_record_age_seconds", frozenset({("outbox", "gauged")}))]
        assert 0 < age <= scraped - written + 0.1, age
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, out, configs={"max.message.bytes": "1000000"})])
        wait_until(lambda: scrape(port)[("kstore_outbox_records_waiting", frozenset({("outbox", "gauged")}))] == 0,
                   90, interval=0.5, what="the gauge to fall to 0")
        assert [v for _, v in read_committed(kafka, out)] == [b"x" * 5000, b"after", b"later"]
        assert scrape(port)[("kstore_outbox_oldest_record_age_seconds", frozenset({("outbox", "gauged")}))] == 0
        assert relay.terminate() == 0, relay.log
    finally:
        relay.cleanup()
