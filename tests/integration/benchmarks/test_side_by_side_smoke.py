"""The side-by-side benchmark (``python -m benchmarks``) still runs end to end, at a tiny size.

Not a performance test: the numbers are not judged, only that every contender
ran, drained its messages and passed the exactly-once check. Uses the test
session's broker and this test's own PostgreSQL database.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from benchmarks.cli import database_latency
from benchmarks.contenders import BY_KEY, RATIOS
from kstore_devbroker.registry import DevRegistry
from tests.support.harness import REPO_DIR

pytestmark = pytest.mark.integration

CONTENDERS = [
    "kafka-python", "confluent-kafka", "at-least-once",
    "kstore-noop", "kstore-handle", "kstore-batch", "kstore-txn-per-msg", "kstore-handle-immediate",
    "kstore-batch-metrics", "kstore-batch-unrecorded",
    "at-least-once-values", "exactly-once-by-hand", "kstore-text", "kstore-copy",
    "kstore-batch-psycopg3", "kstore-handle-psycopg3", "kstore-text-psycopg3", "kstore-copy-psycopg3",
    "exactly-once-by-hand-confluent", "at-least-once-confluent", "kstore-noop-confluent", "kstore-handle-confluent",
    "kstore-batch-confluent", "kstore-text-confluent", "kstore-copy-confluent",
    "kafka-python-defaults", "exactly-once-by-hand-defaults", "database-copy",
    "exactly-once-by-hand-confluent-avro", "kstore-batch-confluent-avro", "confluent-kafka-messages",
    "database-copy-rows",
]


def run_benchmark(kafka: str, dsn: str, registry: str, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks", "--tiny", "--bootstrap-servers", kafka, "--dsn", dsn,
           "--schema-registry-url", registry, "--out", str(out)]
    return subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True, timeout=540, check=False)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_benchmark_runs_every_contender_exactly_once(
    kafka: str, postgresql: Any, schema_registry: DevRegistry, tmp_path: Path
) -> None:
    """Every contender, the Avro pair (29, 30) with the test session's schema registry."""
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"

    done = run_benchmark(kafka, dsn, schema_registry.url, tmp_path)

    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert [c["name"] for c in results["contenders"]] == CONTENDERS
    for c in results["contenders"]:
        assert c["throughput_msgs_per_s"] > 0, c["name"]
        # What the drain cost the machine, for the CPU bounds: read in clock ticks, so a tiny drain may read 0.
        assert c["run_cpu_s"] >= 0, c["name"]
        assert_checked(c["name"], c["exactly_once"], c["messages"])
        if "kstore_settings" in c and c["name"] != "kstore-batch-unrecorded":
            # The worker's own metrics say where its main thread spent the drain.
            m = c["main_thread"]
            assert m["batches"] >= 1 and 0 < m["committing_s"] <= m["in_batches_s"] <= c["seconds"] + 0.5, c["name"]
        if BY_KEY[c["name"]].throughput_only:  # the database's own COPY reads no Kafka while timed
            assert c["latency"] is None, c["name"]
            continue
        assert_checked(c["name"], c["latency"]["exactly_once"], c["latency"]["messages"])
        assert c["latency"]["count"] > 0 and c["latency"]["p99_ms"] >= c["latency"]["p50_ms"] > 0, c["name"]
    assert {c["name"]: c["messages"] for c in results["contenders"]}["kstore-txn-per-msg"] == 100
    assert sum(c["run_cpu_s"] for c in results["contenders"]) > 0
    assert [r["ratio"] for r in results["ratios"]] == [r.key for r in RATIOS]
    assert [t["contender"] for t in results["latency_target"]] == [
        "kstore-handle", "kstore-batch", "kstore-text", "kstore-copy",
        "kstore-handle-confluent", "kstore-batch-confluent", "kstore-text-confluent", "kstore-copy-confluent"]
    settings = {c["name"]: c["kstore_settings"] for c in results["contenders"] if "kstore_settings" in c}
    assert {name: s["kafka_client"] for name, s in settings.items()} == {
        c.name: c.client for c in map(BY_KEY.__getitem__, CONTENDERS) if c.kstore}
    assert [c["client"] for c in results["ceilings"]] == ["kafka-python", "confluent"]
    assert results["parameters"]["schema_registry"] == "external (--schema-registry-url)"
    assert (tmp_path / "benchmark.png").stat().st_size > 0
    assert "throughput ratios" in done.stdout
    assert "ceilings (raw loops, reading only): kafka-python " in done.stdout


@pytest.mark.timeout(300)
def test_baseline_sweep_runs(kafka: str, postgresql: Any, tmp_path: Path) -> None:
    """``python -m benchmarks.sweep --tiny``: each hand-written exactly-once loop drains once per
    combination (on confluent-kafka, with librdkafka's fetch backoff too), checked exactly once,
    and one combination per loop is named the fastest."""
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.sweep", "--tiny", "--bootstrap-servers", kafka, "--dsn", dsn,
         "--out", str(tmp_path)],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=280, check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    summary = json.loads((tmp_path / "sweep.json").read_text())["summary"]
    assert [r["name"] for r in summary] == [
        "exactly-once-by-hand-b1000-p100", "exactly-once-by-hand-b1000-p0",
        "exactly-once-by-hand-confluent-b1000-p100-q100", "exactly-once-by-hand-confluent-b1000-p0-q100"]
    assert sorted(r["number"] for r in summary if r.get("best")) == [12, 19]
    assert done.stdout.count("<- fastest") == 2


def assert_checked(name: str, check: dict[str, Any], messages: int) -> None:
    """The run's exactly-once check looked at what the contender wrote: ``passed`` is always true
    (a failed check stops the benchmark, and its exit code), so the detail is what can be judged."""
    contender = BY_KEY[name]
    detail = check["detail"]
    if contender.writes_rows:
        rows = re.search(r"exactly once: ([\d,]+) rows, ([\d,]+) distinct offsets, ([\d,]+) messages", detail)
        assert rows and {int(n.replace(",", "")) for n in rows.groups()} == {messages}, (name, detail)
    elif not contender.kstore:  # a raw loop: it only reads
        assert f"all {messages:,} messages received" in detail, (name, detail)
    checks = detail.split("; ")
    assert ("stored offsets at the end of every partition" in checks) == contender.kstore, (name, detail)
    assert ("its own stored offsets at the end of every partition" in checks) == contender.own_offsets, (name, detail)


@pytest.mark.timeout(120)
def test_wide_join_benchmark_runs(kafka: str, postgresql: Any) -> None:
    """``python -m benchmarks.wide`` at 20 partitions: every partition claimed, each message delivered."""
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.wide", "--partitions", "20", "--bootstrap-servers", kafka, "--dsn", dsn],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=110, check=False,
    )
    assert "20 stored partitions: claimed and sought" in done.stdout, done.stdout + done.stderr
    assert "20 messages delivered" in done.stdout


def test_db_latency_delays_every_round_trip(pg_dsn: str) -> None:
    """``--db-latency-ms``: the contenders' database is behind a proxy delaying each direction,
    so every round trip takes at least twice that (a database on another machine)."""
    with database_latency(pg_dsn, 0.02) as dsn:
        assert dsn != pg_dsn
        engine = sa.create_engine(dsn)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
                started = time.monotonic()
                for _ in range(5):
                    assert conn.execute(sa.text("SELECT 1")).scalar() == 1
                assert (time.monotonic() - started) / 5 >= 0.04
        finally:
            engine.dispose()


