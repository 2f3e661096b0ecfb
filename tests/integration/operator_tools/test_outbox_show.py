"""`kstore outbox show`: a group's outbox shards as the database holds them (and the outbox line of `kstore top`).

Rows wait while no relay runs (a ``--no-relay`` worker), and are gone once a ``kstore relay``
drained them; a group with no outbox is one line naming the outboxes there are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.ops.outbox import ShardStatus, show_outbox
from kstore.relay.lanes import shard_of
from kstore.relay.store import Outbox
from kstore.types import Produced
from tests.support.harness import SUPPORT_DIR, WorkerProcess, stored_offsets, wait_until
from tests.support.outbox_processors import copies, metadata

BOOKER = "outbox_processors:Booker"
COLUMNS = ["SHARD", "WAITING", "OLDEST", "NEXT_SEQ", "PUBLISHED_SEQ", "OWNER", "LEASE_LEFT"]


def kstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", *args], capture_output=True, text=True, timeout=120,
                          cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})


def shown(dsn: str, group: str) -> list[dict[str, Any]]:
    r = kstore("outbox", "show", "--group", group, "--dsn", dsn, "--json")
    assert r.returncode == 0, r.stderr
    shards: list[dict[str, Any]] = json.loads(r.stdout)
    return shards


@pytest.fixture
def relay(tmp_path: Path, kafka: str) -> Iterator[Callable[[str, str], WorkerProcess]]:
    """Start one ``kstore relay`` subprocess; killed at the end of the test if still running."""
    started: list[WorkerProcess] = []

    def start(dsn: str, group: str) -> WorkerProcess:
        proc = WorkerProcess(["--log-level", "DEBUG", "relay", "--dsn", dsn, "--group", group,
                              "--bootstrap-servers", kafka], {}, tmp_path / "relay.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def test_rows_wait_with_no_relay_and_are_gone_once_a_relay_drained_them(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any, relay: Any) -> None:
    source, out = new_topic(partitions=2), new_topic(partitions=3)
    engine = sa.create_engine(pg_dsn)
    metadata.create_all(engine)
    engine.dispose()
    sent = produce(source, [f"k{i % 12}:{i}" for i in range(300)])
    expected = sum(copies(offset) for _, _, offset in sent)
    ends = {(t, p): max(o for t2, p2, o in sent if (t2, p2) == (t, p)) + 1 for t, p, _ in sent}
    w = workers(pg_dsn, source, "booker", BOOKER, env={"KSTORE_TEST_OUT_TOPIC": out}, args=["--no-relay"])
    wait_until(lambda: stored_offsets(pg_dsn, "booker") == ends, 90, what="every message committed")

    # Committed, and nobody publishes: every record waits, numbered from 1 in each shard.
    shards = shown(pg_dsn, "booker")
    assert len(shards) == Settings().outbox_shards
    assert sum(s["waiting"] for s in shards) == expected
    for s in shards:
        assert (s["published_seq"], s["owner"], s["lease_left_s"]) == (0, None, 0.0), s
        assert s["next_seq"] == s["waiting"] + 1, s
        assert (s["oldest_age_s"] is None) == (s["waiting"] == 0), s
        assert s["oldest_age_s"] is None or s["oldest_age_s"] >= 0, s
    table = kstore("outbox", "show", "--group", "booker", "--dsn", pg_dsn)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.strip().splitlines()
    assert header.split() == COLUMNS
    assert [r.split()[:2] for r in rows] == [[str(s["shard"]), str(s["waiting"])] for s in shards]
    assert all(r.split()[-2:] == ["-", "-"] for r in rows), "no owner and no lease without a relay"
    top = kstore("top", "--once", "--group", "booker", "--dsn", pg_dsn, "--bootstrap-servers", kafka)
    assert top.returncode == 0, top.stderr
    assert f"outbox  {expected} records waiting, oldest " in top.stdout, top.stdout
    assert f"shards held by a relay 0/{len(shards)}" in top.stdout, top.stdout

    # A relay takes every shard and publishes it all: nothing waits, published up to the last seq.
    r = relay(pg_dsn, "booker")

    def all_published() -> list[ShardStatus] | None:
        now = show_outbox(Settings(dsn=pg_dsn), "booker")
        return now if all(x.waiting == 0 and x.published_seq == x.next_seq - 1 for x in now) else None

    drained = wait_until(all_published, 90, interval=0.2, what="the relay to drain the outbox")
    assert [x.next_seq for x in drained] == [s["next_seq"] for s in shards], "nothing more was produced"
    assert all(x.owner and f"-{r.proc.pid}-" in x.owner and x.lease_left_s > 0 for x in drained), drained
    assert all(x.oldest is None and x.oldest_age_s is None for x in drained), drained

    # The relay stops: it gives its shards up, so none has an owner.
    assert r.terminate() == 0
    after = shown(pg_dsn, "booker")
    assert [(s["waiting"], s["owner"], s["published_seq"]) for s in after] == [
        (0, None, x.published_seq) for x in drained]
    assert w.terminate() == 0


def test_a_name_without_an_outbox_is_one_line_naming_the_outboxes_there_are(pg_dsn: str) -> None:
    none_yet = kstore("outbox", "show", "--group", "nope", "--dsn", pg_dsn)
    assert none_yet.returncode == 2 and not none_yet.stdout
    assert none_yet.stderr.count("\n") == 1, none_yet.stderr
    assert none_yet.stderr.startswith("kstore: error: 'nope' has no outbox"), none_yet.stderr
    assert "there is none yet" in none_yet.stderr

    engine = sa.create_engine(pg_dsn)
    try:
        Outbox(engine, "ledger").ensure_shards(2)
        Outbox(engine, "booker").ensure_shards(4)
    finally:
        engine.dispose()
    r = kstore("outbox", "show", "--group", "nope", "--dsn", pg_dsn)
    assert r.returncode == 2 and not r.stdout
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.strip().endswith("outboxes there are: booker, ledger"), r.stderr
    assert len(shown(pg_dsn, "ledger")) == 2


def test_sqlite_rows_waiting_and_the_oldest_age_per_shard(sqlite_dsn: str) -> None:
    """SQLite gives its times back without a timezone: the age is still from the UTC time written."""
    engine = sa.create_engine(sqlite_dsn)
    try:
        outbox = Outbox(engine, "g")
        outbox.ensure_shards(3)
        records = [Produced("out", b"v", f"key-{i}".encode(), (), None) for i in range(20)]
        before = datetime.now(timezone.utc)
        with engine.begin() as conn:
            outbox.write(conn, records)
        after = datetime.now(timezone.utc)
    finally:
        engine.dispose()
    per_shard = [sum(1 for r in records if shard_of(r, 3) == s) for s in range(3)]
    assert all(per_shard), "every shard has rows (the keys are fixed)"
    later = after + timedelta(seconds=30)
    status = show_outbox(Settings(dsn=sqlite_dsn), "g", now=later)
    assert [(s.shard, s.waiting, s.next_seq, s.published_seq) for s in status] == [
        (s, n, n + 1, 0) for s, n in enumerate(per_shard)]
    for s in status:
        assert s.oldest is not None and before <= s.oldest <= after, s
        assert s.oldest_age_s == (later - s.oldest).total_seconds(), s
