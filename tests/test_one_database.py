"""One pipeline, one database: a worker of a group pointed at another database than the
group's is refused (before it claims anything), and `kstore offsets show` on a database
names only owners that write to it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from .harness import TESTS_DIR, assert_exactly_once, effects, wait_until


def show(dsn: str, group: str, kafka: str) -> dict[int, Any]:
    r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "show", "--group", group, "--dsn", dsn,
                        "--bootstrap-servers", kafka, "--json"], capture_output=True, text=True, cwd=TESTS_DIR,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return {row["partition"]: row for row in json.loads(r.stdout)}


def test_a_worker_on_another_database_is_refused_and_not_named_owner(kafka: str, pg_dsn: str, sqlite_dsn: str,
                                                                    new_topic: Any, produce: Any,
                                                                    workers: Any) -> None:
    topic, group = new_topic(2), "one-db"
    first = set(produce(topic, [f"a{i}" for i in range(10)]))
    # A pipeline once ran on SQLite (its offsets are there), then moved to PostgreSQL.
    old = workers(sqlite_dsn, topic, group)
    wait_until(lambda: len(effects(sqlite_dsn)) >= len(first), 60, what="the SQLite run")
    assert old.terminate() == 0
    main = workers(pg_dsn, topic, group)
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the PostgreSQL worker's first messages")
    assert all(row["owner"] for row in show(pg_dsn, group, kafka).values())
    assert not any(row["owner"] for row in show(sqlite_dsn, group, kafka).values()), "named another database's owner"

    # A worker still pointed at the old database joins: refused, one line, exit 2, nothing claimed.
    stray = workers(sqlite_dsn, topic, group)
    assert stray.proc.wait(timeout=60) == 2
    assert "is already consumed by workers writing to another database" in stray.log
    assert "claimed " in main.log  # the line a claim logs, absent from the stray's
    assert "claimed " not in stray.log.split("INFO kstore.engine.worker: worker ")[-1]
    assert "writes to another database" in main.log  # the group's leader said so too
    more = set(produce(topic, [f"b{i}" for i in range(20)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | more), 60, what="the later messages")
    assert main.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | more)
    assert_exactly_once(effects(sqlite_dsn), first)
