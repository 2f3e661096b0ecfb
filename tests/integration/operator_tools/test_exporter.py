"""`kstore exporter`: the lag of a group with no worker running, scraped over HTTP from a real broker and database."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from kstore import Settings
from kstore.db.store import make_engine
from kstore.ops.lag import LagReader
from kstore.outbox import Outbox
from tests.conftest import KAFKA_CLIENT
from tests.support.faultproxy import FaultProxy
from tests.support.harness import SUPPORT_DIR, WorkerProcess, stored_offsets, wait_until
from tests.support.outbox_backlogs import group_outbox

Metrics = dict[str, dict[tuple[tuple[str, str], ...], float]]


class Exporter:
    """A `kstore exporter` subprocess on a port it picked itself (--port 0), read from its log."""

    def __init__(self, proc: WorkerProcess) -> None:
        self.proc = proc
        proc.wait_for_log(r"serving metrics of .* on http://127\.0\.0\.1:\d+/metrics", timeout=30)
        found = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", proc.log)
        assert found
        self.port = int(found.group(1))

    def scrape(self) -> Metrics:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as answer:
            body = answer.read().decode()
        out: Metrics = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return out


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[Callable[..., Exporter]]:
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Exporter:
        proc = WorkerProcess(["exporter", "--port", "0", "--address", "127.0.0.1", *args], env or {},
                             tmp_path / f"exporter{len(started) + 1}.log")
        started.append(proc)
        return Exporter(proc)

    yield start
    for proc in started:
        proc.cleanup()


def per_partition(metrics: Metrics, name: str, group: str) -> dict[int, float]:
    return {int(dict(labels)["partition"]): value for labels, value in metrics.get(name, {}).items()
            if dict(labels)["group"] == group}


def one(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics[name][tuple(sorted(labels.items()))]


def kstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", *args], capture_output=True, text=True, timeout=60,
                          cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})


def test_lag_of_a_group_with_no_worker_in_messages_and_seconds_then_zero_after_catching_up(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any, exporter: Any) -> None:
    topic, group = new_topic(partitions=2), "exported"
    produce(topic, (f"a{i}" for i in range(30)), partition=0)
    produce(topic, (f"b{i}" for i in range(20)), partition=1)
    w = workers(pg_dsn, topic, group)
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 30, (topic, 1): 20}, 60)
    assert w.terminate() == 0

    before_produce = time.time()
    produce(topic, (f"c{i}" for i in range(12)), partition=0)
    produce(topic, (f"d{i}" for i in range(7)), partition=1)
    after_produce = time.time()
    time.sleep(1.5)  # so the oldest unprocessed message is measurably old
    exp = exporter("--group", group, "--dsn", pg_dsn, "--bootstrap-servers", kafka)
    scrape_started = time.time()
    m = exp.scrape()
    scrape_ended = time.time()

    assert one(m, "kstore_exporter_up", group=group) == 1
    assert per_partition(m, "kstore_lag_messages", group) == {0: 12, 1: 7}, "produced minus processed"
    assert per_partition(m, "kstore_stored_offset", group) == {0: 30, 1: 20}
    assert per_partition(m, "kstore_log_end_offset", group) == {0: 42, 1: 27}
    assert one(m, "kstore_dead_letters_waiting", group=group) == 0
    ages = per_partition(m, "kstore_lag_seconds", group)
    for partition, age in ages.items():  # the age of the first message produced after the worker stopped
        assert scrape_started - after_produce - 0.1 <= age <= scrape_ended - before_produce + 0.1, (partition, ages)

    later = exp.scrape()
    assert per_partition(later, "kstore_lag_messages", group) == {0: 12, 1: 7}
    assert all(per_partition(later, "kstore_lag_seconds", group)[p] > ages[p] for p in ages), "the same message, older"

    # An operator replays 5 messages of partition 0: its lag grows by 5, and the oldest waiting is older still.
    shifted = kstore("offsets", "set", "--group", group, "--topic", topic, "--partition", "0", "--shift-by", "-5",
                     "--reason", "replay", "--execute", "--dsn", pg_dsn, "--bootstrap-servers", kafka)
    assert shifted.returncode == 0, shifted.stderr
    scrape_started = time.time()
    m = exp.scrape()
    assert per_partition(m, "kstore_lag_messages", group) == {0: 17, 1: 7}
    assert per_partition(m, "kstore_stored_offset", group) == {0: 25, 1: 20}
    assert per_partition(m, "kstore_lag_seconds", group)[0] > scrape_started - before_produce, "a25 predates c0"

    # A worker comes back and catches up, while the exporter keeps serving.
    w2 = workers(pg_dsn, topic, group)
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 42, (topic, 1): 27}, 60)
    m = exp.scrape()
    assert per_partition(m, "kstore_lag_messages", group) == {0: 0, 1: 0}
    assert per_partition(m, "kstore_lag_seconds", group) == {0: 0, 1: 0}
    assert w2.terminate() == 0
    assert exp.proc.terminate() == 0, exp.proc.log


def committed_then_behind(pg_dsn: str, topic: str, group: str, produce: Any, workers: Any, *,
                          committed: int, behind: int) -> None:
    """Partition 0 of ``topic``: ``committed`` messages processed by a worker that then stops,
    and ``behind`` more produced after it, so the group lags by them."""
    produce(topic, ["x"] * committed, partition=0)
    w = workers(pg_dsn, topic, group)
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): committed}, 60)
    assert w.terminate() == 0
    produce(topic, ["y"] * behind, partition=0)


def test_an_unchanged_offset_is_not_fetched_again(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                                  workers: Any) -> None:
    topic, group = new_topic(partitions=1), "cached"
    committed_then_behind(pg_dsn, topic, group, produce, workers, committed=3, behind=4)

    fetched: list[dict[tuple[str, int], int]] = []

    class Counting(LagReader):
        def _fetch_timestamps(self, offsets: Any) -> Any:
            fetched.append(dict(offsets))
            return super()._fetch_timestamps(offsets)

    reader = Counting(Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT))
    try:
        first, second = reader.read(group), reader.read(group)
        assert fetched == [{(topic, 0): 3}], "the second reading used the cached timestamp"
        ages = [reading.partitions[0].lag_seconds or 0.0 for reading in (first, second)]
        assert ages[1] > ages[0] > 0
        produce(topic, ["z"], partition=0)
        assert reader.read(group).partitions[0].lag_messages == 5
        assert len(fetched) == 1, "a new message at the log end does not change the oldest one"
    finally:
        reader.close()


def test_database_or_broker_outage_is_an_error_not_stale_numbers(pg_dsn: str, kafka: str, new_topic: Any,
                                                                 produce: Any, workers: Any,
                                                                 exporter: Any) -> None:
    topic, group = new_topic(partitions=1), "outage"
    committed_then_behind(pg_dsn, topic, group, produce, workers, committed=5, behind=2)
    address = re.search(r"@([^:/]+):(\d+)/", pg_dsn)
    assert address, pg_dsn
    host, port = address.groups()
    with FaultProxy(host, int(port)) as proxy:
        exp = exporter("--group", group, "--dsn", proxy.dsn_through(pg_dsn), "--bootstrap-servers", kafka,
                       env={"KSTORE_DB_TIMEOUT_S": "2"})
        m = exp.scrape()
        assert one(m, "kstore_exporter_up", group=group) == 1
        assert per_partition(m, "kstore_lag_messages", group) == {0: 2}

        proxy.blackhole()  # the database stops answering
        proxy.cut_all()
        m = exp.scrape()
        assert one(m, "kstore_exporter_up", group=group) == 0
        assert one(m, "kstore_exporter_scrape_errors_total", group=group, source="database") == 1
        assert not per_partition(m, "kstore_lag_messages", group), "no stale lag while the database is down"
        assert "kstore_dead_letters_waiting" not in m

        proxy.heal()
        m = wait_until(lambda: (s := exp.scrape()) and one(s, "kstore_exporter_up", group=group) == 1 and s, 30)
        assert per_partition(m, "kstore_lag_messages", group) == {0: 2}
        assert one(m, "kstore_exporter_scrape_errors_total", group=group, source="database") >= 1
        assert "cannot read group 'outage' (database)" in exp.proc.log
        assert exp.proc.terminate() == 0

    # A port nobody listens on (the brokers are down), held bound for the whole test so that no
    # other process can take it meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_brokers = f"127.0.0.1:{s.getsockname()[1]}"
        exp = exporter("--group", group, "--dsn", pg_dsn, "--bootstrap-servers", dead_brokers,
                       env={"KSTORE_CONNECT_TIMEOUT_S": "2"})
        m = exp.scrape()
        assert one(m, "kstore_exporter_up", group=group) == 0
        assert one(m, "kstore_exporter_scrape_errors_total", group=group, source="kafka") == 1
        assert not per_partition(m, "kstore_lag_messages", group)
        assert exp.proc.proc.poll() is None, "still serving"
        assert exp.proc.terminate() == 0


def test_every_outbox_in_the_database_has_its_gauges_an_applications_too(pg_dsn: str, kafka: str,
                                                                         exporter: Any) -> None:
    """An application's outbox with records waiting, and a group's with none, neither of them a group the
    exporter was given: both have their records waiting and the oldest's age."""
    engine = make_engine(Settings(dsn=pg_dsn))
    group_outbox(engine, "drained", shards=2)
    events = Outbox("shop-web", Settings(dsn=pg_dsn), shards=4)
    before_write = time.time()
    with Session(engine) as session, session.begin():
        for n in range(3):
            events.produce(session, "orders", {"n": n}, key=f"k{n}")
    after_write = time.time()
    engine.dispose()
    time.sleep(1.0)  # so the oldest record is measurably old

    exp = exporter("--group", "some-pipeline", "--dsn", pg_dsn, "--bootstrap-servers", kafka)
    scrape_started = time.time()
    m = exp.scrape()
    scrape_ended = time.time()
    assert m["kstore_outbox_records_waiting"] == {(("outbox", "drained"),): 0, (("outbox", "shop-web"),): 3}
    ages = m["kstore_outbox_oldest_record_age_seconds"]
    assert ages[(("outbox", "drained"),)] == 0
    age = ages[(("outbox", "shop-web"),)]
    assert scrape_started - after_write - 0.1 <= age <= scrape_ended - before_write + 0.1, age
    assert one(m, "kstore_exporter_up", group="some-pipeline") == 1
    assert exp.proc.terminate() == 0


def test_bad_configuration_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad_dsn = kstore("exporter", "--group", "g", "--port", "0", "--dsn", "nosuchdb://x")
    assert bad_dsn.returncode == 2 and bad_dsn.stderr.count("\n") == 1, bad_dsn.stderr
    assert bad_dsn.stderr.startswith("kstore: error: ")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = kstore("exporter", "--group", "g", "--port", port, "--address", "127.0.0.1",
                      "--dsn", f"sqlite:///{tmp_path / 'k.db'}")
    assert busy.returncode == 2, busy.stderr
    assert busy.stderr.strip().splitlines() == [f"kstore: error: cannot serve on 127.0.0.1:{port}: "
                                                "Address already in use"]

    no_group = kstore("exporter", "--port", "0")
    assert no_group.returncode == 2 and "--group" in no_group.stderr
