"""The kstore command as a new user first runs it: its version, and every command on psycopg 3."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def test_version() -> None:
    r = subprocess.run([sys.executable, "-m", "kstore", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kstore ") and r.stdout.split()[1][0].isdigit()


def test_every_command_on_psycopg_3(pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """`postgresql+psycopg://` (psycopg 3) beside psycopg2: migrate, a worker, offsets show/set/history,
    dead letters (the in-doubt and silent-database paths:
    tests/integration/faults_and_in_doubt/test_worker_in_doubt.py)."""
    from tests.support.harness import assert_exactly_once, effects, wait_until, with_driver

    dsn = with_driver(pg_dsn, "psycopg")

    def kstore(*args: str) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, "-m", "kstore", *args, "--dsn", dsn], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r

    kstore("migrate")
    topic = new_topic(2)
    sent = set(produce(topic, [f"p{i}" for i in range(200)]))
    w = workers(dsn, topic, "psycopg3")
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message processed")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    shown = json.loads(kstore("offsets", "show", "--group", "psycopg3", "--bootstrap-servers", kafka, "--json").stdout)
    assert sum(row["next_offset"] for row in shown) == len(sent)
    kstore("offsets", "set", "--group", "psycopg3", "--topic", topic, "--shift-by", "-5", "--bootstrap-servers",
           kafka, "--reason", "replay the last five", "--execute")
    history = json.loads(kstore("offsets", "history", "--group", "psycopg3", "--json").stdout)
    assert len([h for h in history if h["from_offset"] is not None and h["to_offset"] == h["from_offset"] - 5]) == 2
    kstore("dead-letters", "list", "--group", "psycopg3")
