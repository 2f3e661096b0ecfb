"""A running worker seen from outside: /metrics, /livez and /readyz of real `kstore worker`
processes (real broker, real PostgreSQL), scraped over HTTP while they work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from tests.support.faultproxy import FaultProxy
from tests.support.harness import SUPPORT_DIR, assert_exactly_once, effects, stored_offsets, wait_until


def port_of(w: Any) -> int:
    w.wait_for_log(r"serving /metrics, /livez and /readyz on http://[^:]+:\d+")
    return int(re.search(r"serving /metrics, /livez and /readyz on http://[^:]+:(\d+)", w.log).group(1))  # type: ignore[union-attr]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    status, text = get(port, "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def by_partition(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> dict[int, float]:
    return {int(dict(ls)["partition"]): v for (n, ls), v in samples.items() if n == name}


@pytest.fixture
def table_lock(pg_dsn: str) -> Iterator[Any]:
    """Hold an exclusive lock on kstore_offsets until released: claims wait (and time out)."""
    engine = sa.create_engine(pg_dsn)
    conn = engine.connect()
    trans = conn.begin()
    conn.execute(sa.text("LOCK TABLE kstore_offsets IN ACCESS EXCLUSIVE MODE"))
    yield trans
    if trans.is_active:
        trans.rollback()
    conn.close()
    engine.dispose()


def test_metrics_and_readiness_of_a_worker_draining_a_backlog(
        kafka: str, pg_dsn: str, table_lock: Any, new_topic: Any, produce: Any, workers: Any,
        tmp_path: Path) -> None:
    """/readyz is 503 until the claim lands, 200 after; committed messages reach the produced count
    and the lag falls to 0; a dead letter, a fenced commit and a rebalance each move their counter."""
    topic, group = new_topic(2), "metrics"
    sent = set(produce(topic, [f"m{i}" for i in range(1500)]))
    (poison,) = produce(topic, ["poison"], partition=1)
    pause = tmp_path / "pause"
    w = workers(pg_dsn, topic, group, args=["--metrics-port", "0", "--on-error", "dead_letter", "--max-attempts", "1"],
                env={"KSTORE_TEST_FAIL_VALUE": "poison", "KSTORE_MAX_BATCH_SIZE": "100",
                     "KSTORE_TEST_BATCH_SLEEP": "0.1", "KSTORE_CLAIM_LOCK_TIMEOUT_MS": "500",
                     "KSTORE_TEST_PAUSE_FILE": str(pause)})
    port = port_of(w)
    status, why = get(port, "/readyz")
    assert status == 503, why
    assert get(port, "/livez")[0] == 200
    table_lock.rollback()  # the claim can land now
    wait_until(lambda: get(port, "/readyz")[0] == 200, 30, what="ready once claimed")
    # Some batches commit; then the next waits (pause file) until the test lets it go, so the backlog
    # cannot drain before the lag is scraped and the batch in flight is fenced, however fast the
    # machine (what is left takes more than a second of the processor's sleeps alone).
    wait_until(lambda: (stored_offsets(pg_dsn, group).get((topic, 0)) or 0) >= 20, 60, what="some batches")
    pause.touch()
    wait_until(lambda: Path(f"{pause}.batch").exists(), 30, what="a batch in flight")

    # While the backlog waits, the lag is seen above 0, in messages and in seconds. A partition's
    # seconds are absent until its messages are fetched (the log end can be known first), so one
    # scrape is waited for where both are seen on the same partition.
    def lagging() -> dict[int, tuple[float, float]] | None:
        s = scrape(port)
        seconds = by_partition(s, "kstore_lag_seconds")
        both = {p: (m, seconds[p]) for p, m in by_partition(s, "kstore_lag_messages").items() if m > 0 and p in seconds}
        return both or None

    for messages, seconds in wait_until(lagging, 30, interval=0.05, what="a lag above 0").values():
        assert messages > 0 and seconds > 0, (messages, seconds)

    # A batch in flight when an operator moves partition 0 back by 10: its commit is fenced.
    r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "set", "--group", group, "--topic", topic,
                        "--partition", "0", "--shift-by", "-10", "--clamp", "--dsn", pg_dsn,
                        "--bootstrap-servers", kafka, "--reason", "replay", "--execute"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pause.unlink()
    wait_until(lambda: total(scrape(port), "kstore_fenced_commits_total") >= 1, 30, what="the fenced commit counted")

    ends = {p: 1 + max(o for t, pp, o in sent | {poison} if pp == p) for p in (0, 1)}
    def caught_up() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        s = scrape(port)
        return s if by_partition(s, "kstore_lag_messages") == {0: 0, 1: 0} else None

    s = wait_until(caught_up, 60, what="the lag at 0")
    assert by_partition(s, "kstore_lag_seconds") == {0: 0, 1: 0}
    # Every message once, plus the 10 the operator replayed (the dead letter is not a committed message).
    assert total(s, "kstore_messages_committed_total") == len(sent) + 10
    assert by_partition(s, "kstore_messages_committed_total") == {0: ends[0] + 10, 1: ends[1] - 1}
    assert total(s, "kstore_dead_letters_written_total") == 1
    assert total(s, "kstore_batches_rolled_back_total", reason="error") >= 1
    assert total(s, "kstore_batches_rolled_back_total", reason="fenced") >= 1
    assert total(s, "kstore_partitions_owned") == 2
    assert total(s, "kstore_batch_size_messages_count") == total(s, "kstore_batches_committed_total") > 0
    assert total(s, "kstore_claim_duration_seconds_count") >= 1
    assert total(s, "process_resident_memory_bytes") > 0
    rebalances = total(s, "kstore_rebalances_total")

    # A second worker joins: the first is rebalanced.
    w2 = workers(pg_dsn, topic, group)
    wait_until(lambda: total(scrape(port), "kstore_rebalances_total") > rebalances, 60, what="a rebalance counted")
    assert w2.terminate() == 0
    assert w.terminate() == 0
    counts = effects(pg_dsn)
    assert sum(counts.values()) == len(sent) + 10


def test_livez_turns_unhealthy_while_a_handler_is_stuck(pg_dsn: str, new_topic: Any, produce: Any, workers: Any,
                                                        tmp_path: Path) -> None:
    topic = new_topic(1)
    pause = tmp_path / "pause"
    pause.touch()
    w = workers(pg_dsn, topic, "livez", args=["--metrics-port", "0"],
                env={"KSTORE_LIVENESS_TIMEOUT_S": "2", "KSTORE_TEST_PAUSE_FILE": str(pause)})
    port = port_of(w)
    wait_until(lambda: get(port, "/readyz")[0] == 200, 30, what="ready")
    assert get(port, "/livez")[0] == 200
    sent = set(produce(topic, ["stuck"]))
    wait_until(lambda: Path(f"{pause}.batch").exists(), 30, what="the handler stuck")
    _status, why = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(get(port, "/livez")), 10,
                             what="/livez unhealthy")
    assert "the batch loop has not turned" in why
    pause.unlink()
    wait_until(lambda: get(port, "/livez")[0] == 200, 10, what="/livez healthy again")
    wait_until(lambda: len(effects(pg_dsn)) == 1, 30, what="the message processed")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)


def test_readyz_is_503_while_the_database_is_away(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic = new_topic(1)
    url = sa.make_url(pg_dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        w = workers(proxy.dsn_through(pg_dsn), topic, "readyz-db", args=["--metrics-port", "0"],
                    env={"KSTORE_DB_TIMEOUT_S": "2", "KSTORE_EPOCH_CHECK_INTERVAL_S": "0.5"})
        port = port_of(w)
        wait_until(lambda: get(port, "/readyz")[0] == 200, 30, what="ready")
        proxy.blackhole()
        _status, why = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(get(port, "/readyz")), 20,
                                 what="/readyz unhealthy during the outage")
        assert "database" in why
        assert get(port, "/livez")[0] == 200  # away is not stuck: do not restart it
        proxy.heal()
        proxy.cut_all()
        wait_until(lambda: get(port, "/readyz")[0] == 200, 30, what="ready again")
        sent = set(produce(topic, [f"after{i}" for i in range(20)]))
        wait_until(lambda: len(effects(pg_dsn)) == 20, 30, what="messages after the outage")
        assert total(scrape(port), "kstore_database_errors_total") >= 1
        assert w.terminate() == 0
        assert_exactly_once(effects(pg_dsn), sent)


def test_json_logs_carry_the_group_and_the_message(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic = new_topic(1)
    w = workers(pg_dsn, topic, "jsonlogs", env={"KSTORE_LOG_FORMAT": "json", "KSTORE_TEST_FAIL_VALUE": "bad"},
                args=["--on-error", "dead_letter", "--max-attempts", "2"])
    produce(topic, ["ok", "bad", "ok2"])
    wait_until(lambda: len(effects(pg_dsn)) == 2, 60, what="the good messages")
    w.wait_for_log("dead-lettered")
    assert w.terminate() == 0
    lines = [json.loads(line) for line in w.log.splitlines() if line.startswith("{")]
    assert lines and len(lines) == len([ln for ln in w.log.splitlines() if ln.strip()]), w.log[-2000:]
    assert all({"time", "level", "logger", "message"} <= set(d) for d in lines)
    dead = [d for d in lines if d["message"].startswith("dead-lettered")]
    assert len(dead) == 1 and dead[0]["group"] == "jsonlogs"
    assert (dead[0]["topic"], dead[0]["partition"], dead[0]["offset"]) == (topic, 0, 1)



def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at ``port`` (from /proc/net/tcp: hex, little-endian)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


@pytest.mark.parametrize(("args", "env", "address"), [
    ([], {}, "0.0.0.0"),  # the default: every interface, as Kubernetes probes need
    (["--metrics-host", "127.0.0.1"], {}, "127.0.0.1"),
    ([], {"KSTORE_METRICS_HOST": "127.0.0.1"}, "127.0.0.1"),
])
def test_the_metrics_port_listens_on_the_address_asked_for(pg_dsn: str, new_topic: Any, workers: Any,
                                                           args: list[str], env: dict[str, str],
                                                           address: str) -> None:
    w = workers(pg_dsn, new_topic(1), "metrics-host", args=["--metrics-port", "0", *args], env=env)
    port = port_of(w)
    assert f"serving /metrics, /livez and /readyz on http://{address}:{port}" in w.log
    assert listening_addresses(port) == {address}
    assert get(port, "/livez")[0] == 200
    assert w.terminate() == 0


def test_a_metrics_host_that_is_not_this_hosts_is_one_line(sqlite_dsn: str, kafka: str, new_topic: Any) -> None:
    r = subprocess.run([sys.executable, "-m", "kstore", "worker", "processors:Recorder", "--dsn", sqlite_dsn,
                        "--bootstrap-servers", kafka, "--topic", new_topic(1), "--metrics-port", "0",
                        "--metrics-host", "192.0.2.1"], capture_output=True, text=True, timeout=120,
                       cwd=SUPPORT_DIR)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "kstore: error: cannot serve /metrics on 192.0.2.1:0 (metrics_host, metrics_port): "), r.stderr
