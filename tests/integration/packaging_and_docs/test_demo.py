"""The demo (examples/demo.py, what ``scripts/demo`` runs) needs confluent-kafka alone: its local broker,
its topics, its records and its read_committed reader work where kafka-python is not installed, in the
demo's process and in the workers it starts.

The demo keeps its files in one folder of the checkout (.kstore-dev/demo): one demo runs at a time,
under a lock, whichever test process or test session starts it."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import REPO_DIR, without_kafka_python


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Any]:
    """``demo(*args)``: run examples/demo.py with the defaults a new user meets (none of the tests'
    KSTORE_* settings) and without kafka-python, alone in the checkout; its completed process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([without_kafka_python(tmp_path), os.environ.get("PYTHONPATH", "")])
    lock_path = REPO_DIR / ".kstore-dev" / "demo.lock"
    lock_path.parent.mkdir(exist_ok=True)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(REPO_DIR / "examples" / "demo.py"), *args], capture_output=True,
                              text=True, timeout=300, env=env, cwd=tmp_path)

    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield run


def test_the_demo_runs_without_kafka_python(demo: Any) -> None:
    """Both pipelines, one after the other."""
    for pipeline, done in [("pageviews", "demo: every view counted exactly once"),
                           ("payments", "demo: every payment booked once and announced exactly once")]:
        r = demo("--pipeline", pipeline, "--events", "2000", "--no-crash")
        assert r.returncode == 0, r.stdout + r.stderr
        assert done in r.stdout, r.stdout
        assert "stopped the local broker" in r.stdout, r.stdout


def test_the_avro_pipeline_is_exactly_once_through_a_schema_registry(demo: Any) -> None:
    """Avro orders, the schema evolving mid-stream, 20 records that are not Avro, a SIGKILL: every order
    announced once in Avro (decoded by confluent-kafka's AvroDeserializer), exactly the bad ones dead-lettered."""
    r = demo("--pipeline", "orders-avro", "--events", "3000")
    assert r.returncode == 0, r.stdout + r.stderr
    # The summary's rows: a name in 34 columns, then a count (or "N of M").
    rows = re.findall(r"^(?!demo:)(\S.{33}|  .{32})\s*(\d+(?: of \d+)?)$", r.stdout, re.MULTILINE)
    summary = {name.strip(): value for name, value in rows}
    assert summary == {
        "orders accepted and announced": "3000",
        "order-accepted events read": "3000",
        "announced twice": "0",
        "never announced": "0",
        "bad records dead-lettered": "20 of 20",
        "v1 orders read with currency EUR": "1500 of 1500",
    }, r.stdout
    assert "demo: killed the worker with SIGKILL" in r.stdout, r.stdout
    assert "demo: every order accepted once and announced exactly once in Avro" in r.stdout, r.stdout
    assert "stopped the schema registry" in r.stdout and "stopped the local broker" in r.stdout, r.stdout
