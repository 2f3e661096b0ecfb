"""`kstore offsets show/set/history` and online resets picked up by running workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import TopicPartition

from kstore import ConfigurationError, Settings
from kstore.ops.offsets import set_offsets, show_offsets
from tests.conftest import KAFKA_CLIENT
from tests.integration.cli.test_cli import assert_one_clear_line
from tests.support.harness import SUPPORT_DIR, effects, stored_offsets, wait_until


def kstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", *args], capture_output=True, text=True, timeout=120,
                          cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})


def history_reasons(dsn: str, group: str) -> list[str]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT reason FROM kstore_offset_history WHERE consumer_group = :g ORDER BY id"),
                            {"g": group}).all()
    engine.dispose()
    return [r[0] for r in rows]


def stored_owners(dsn: str, group: str) -> set[str]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT owner FROM kstore_offsets WHERE consumer_group = :g"), {"g": group}).all()
    engine.dispose()
    return {r[0] for r in rows}


def test_show_reports_lag_epoch_and_live_owner(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                              workers: Any) -> None:
    topic = new_topic(partitions=2)
    produce(topic, (f"v{i}" for i in range(60)), partition=0)
    produce(topic, (f"v{i}" for i in range(40)), partition=1)
    w = workers(pg_dsn, topic, "shown")
    wait_until(lambda: len(effects(pg_dsn)) == 100, 60)
    r = kstore("offsets", "show", "--group", "shown", "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--json")
    assert r.returncode == 0, r.stderr
    live = {(s["topic"], s["partition"]): s for s in json.loads(r.stdout)}
    assert {tp: (s["next_offset"], s["log_end"], s["lag"]) for tp, s in live.items()} == {
        (topic, 0): (60, 60, 0), (topic, 1): (40, 40, 0)}
    # The owner is spelled as in the worker's log lines and in the rows it claimed.
    assert {s["owner"] for s in live.values()} == {w.name}, (live, w.name)
    assert w.name.startswith("kstore-") and f"-{w.proc.pid}-" in w.name
    assert stored_owners(pg_dsn, "shown") == {w.name}
    assert all(s["epoch"] >= 1 for s in live.values()), live
    assert w.terminate() == 0

    produce(topic, (f"x{i}" for i in range(25)), partition=0)
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT)
    status = {(s.topic, s.partition): s for s in show_offsets(settings, "shown")}
    assert (status[(topic, 0)].lag, status[(topic, 1)].lag) == (25, 0)
    assert status[(topic, 0)].owner is None, "no live worker after SIGTERM"
    table = kstore("offsets", "show", "--group", "shown", "--dsn", pg_dsn, "--bootstrap-servers", kafka)
    assert table.returncode == 0, table.stderr
    header, first, _second = table.stdout.strip().splitlines()
    assert header.split() == ["TOPIC", "PARTITION", "NEXT_OFFSET", "LOG_START", "LOG_END", "LAG", "EPOCH", "UPDATED",
                              "OWNER"]
    assert first.split()[:6] == [topic, "0", "60", "0", "85", "25"]


def test_dry_run_changes_nothing_execute_applies_and_records(pg_dsn: str, kafka: str, new_topic: Any,
                                                             produce: Any, workers: Any) -> None:
    topic = new_topic(partitions=2)
    produce(topic, (f"v{i}" for i in range(50)), partition=0)
    produce(topic, (f"v{i}" for i in range(50)), partition=1)
    for group in ("alpha", "beta"):  # two pipelines on one topic
        w = workers(pg_dsn, topic, group)
        wait_until(lambda g=group: stored_offsets(pg_dsn, g) == {(topic, 0): 50, (topic, 1): 50}, 60)
        assert w.terminate() == 0
    base = ["offsets", "set", "--group", "alpha", "--topic", topic, "--dsn", pg_dsn, "--bootstrap-servers", kafka]

    dry = kstore(*base, "--partition", "0", "--to-offset", "10")
    assert dry.returncode == 0, dry.stderr
    assert "dry run" in dry.stdout and dry.stdout.splitlines()[1].split() == [topic, "0", "50", "10"], dry.stdout
    assert stored_offsets(pg_dsn, "alpha") == {(topic, 0): 50, (topic, 1): 50}

    # --execute without a reason (or a blank one) is refused before anything is read or written.
    for no_reason in ([], ["--reason", "  "]):
        refused = kstore(*base, "--partition", "0", "--to-offset", "10", *no_reason, "--execute")
        assert_one_clear_line(refused, "give a reason for the reset (--reason)")
    assert stored_offsets(pg_dsn, "alpha") == {(topic, 0): 50, (topic, 1): 50}
    with pytest.raises(ConfigurationError, match=r"give a reason for the reset"):
        set_offsets(Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT), "alpha", topic,
                    to_offset=10, execute=True)

    done = kstore(*base, "--partition", "0", "--to-offset", "10", "--reason", "replay the tail", "--execute")
    assert done.returncode == 0, done.stderr
    assert stored_offsets(pg_dsn, "alpha") == {(topic, 0): 10, (topic, 1): 50}
    assert stored_offsets(pg_dsn, "beta") == {(topic, 0): 50, (topic, 1): 50}, "the other pipeline must not move"
    hist = kstore("offsets", "history", "--group", "alpha", "--dsn", pg_dsn, "--json")
    assert hist.returncode == 0, hist.stderr
    latest = json.loads(hist.stdout)[0]
    assert (latest["partition_id"], latest["from_offset"], latest["to_offset"]) == (0, 50, 10)
    assert latest["reason"] == "kstore offsets set: replay the tail" and latest["by_user"] and latest["by_host"]

    # Out of range: refused, nothing changes; --clamp moves to the nearest end.
    refused = kstore(*base, "--shift-by", "500", "--reason", "too far", "--execute")
    assert refused.returncode == 2 and "past the log end 50" in refused.stderr, refused.stderr
    assert stored_offsets(pg_dsn, "alpha") == {(topic, 0): 10, (topic, 1): 50}
    clamped = kstore(*base, "--shift-by", "-500", "--clamp", "--reason", "to the start", "--execute")
    assert clamped.returncode == 0, clamped.stderr
    assert stored_offsets(pg_dsn, "alpha") == {(topic, 0): 0, (topic, 1): 0}


def test_to_datetime_lands_on_first_offset_at_or_after(pg_dsn: str, kafka: str, new_topic: Any,
                                                       produce: Any) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"a{i}" for i in range(30)))
    time.sleep(0.05)
    between = datetime.now(timezone.utc)
    time.sleep(0.05)
    produce(topic, (f"b{i}" for i in range(30)))
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT)
    plan = set_offsets(settings, "timed", topic, to_datetime=between, execute=True, reason="test")
    assert [(p.partition, p.from_offset, p.to_offset) for p in plan] == [(0, None, 30)]
    assert stored_offsets(pg_dsn, "timed") == {(topic, 0): 30}
    r = kstore("offsets", "set", "--group", "timed", "--topic", topic, "--dsn", pg_dsn, "--bootstrap-servers", kafka,
               "--to-datetime", between.isoformat())
    assert r.returncode == 0 and r.stdout.splitlines()[1].split() == [topic, "0", "30", "30"], r.stdout + r.stderr


def test_online_replay_and_skip_without_restart(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                               workers: Any, tmp_path: Path) -> None:
    topic = new_topic(partitions=2)
    produce(topic, (f"v{i}" for i in range(300)), partition=0)
    produce(topic, (f"v{i}" for i in range(300)), partition=1)
    pause = tmp_path / "pause"
    w = workers(pg_dsn, topic, "online", env={"KSTORE_TEST_PAUSE_FILE": str(pause)}, args=["--max-batch-size", "50"])
    wait_until(lambda: len(effects(pg_dsn)) == 600, 60)
    base = ["offsets", "set", "--group", "online", "--topic", topic, "--partition", "0",
            "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--reason", "online reset", "--execute"]

    # Replay: back by 100 while the partition is idle.
    r = kstore(*base, "--shift-by", "-100")
    assert r.returncode == 0, r.stderr
    applied = time.monotonic()
    wait_until(lambda: effects(pg_dsn)[(topic, 0, 200)] == 2, 10, interval=0.05, what="the replay to start")
    noticed = time.monotonic() - applied
    wait_until(lambda: stored_offsets(pg_dsn, "online")[(topic, 0)] == 300, 30)
    counts = effects(pg_dsn)
    assert {o: counts[(topic, 0, o)] for o in range(300)} == {o: (2 if o >= 200 else 1) for o in range(300)}
    assert all(counts[(topic, 1, o)] == 1 for o in range(300))

    # Skip: forward by 100 while a batch of that partition is in flight; the in-flight batch must not land.
    pause.write_text("")
    produce(topic, (f"w{i}" for i in range(200)), partition=0)  # offsets 300..499
    batch_file = Path(str(pause) + ".batch")
    wait_until(batch_file.exists, 30, what="a batch in flight")
    assert batch_file.read_text() == "0:300"
    r = kstore(*base, "--shift-by", "100")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split() == [topic, "0", "300", "400"], r.stdout
    pause.unlink()
    wait_until(lambda: stored_offsets(pg_dsn, "online")[(topic, 0)] == 500, 30)
    time.sleep(1)
    counts = effects(pg_dsn)
    assert not [o for o in range(300, 400) if counts[(topic, 0, o)]], "skipped messages were processed"
    assert all(counts[(topic, 0, o)] == 1 for o in range(400, 500))
    assert w.terminate() == 0
    assert "reset to 400 by an operator" in w.log
    assert "claimed" in w.log and w.log.count("claimed ") == 1, "picked up without a restart or rebalance"
    print(f"replay noticed {noticed:.2f}s after `kstore offsets set` returned")


def test_recreated_topic_is_held_until_an_operator_decides(pg_dsn: str, kafka: str, new_topic: Any,
                                                            produce: Any, workers: Any) -> None:
    topic = new_topic(partitions=2)
    produce(topic, (f"v{i}" for i in range(20)), partition=0)
    produce(topic, (f"v{i}" for i in range(20)), partition=1)
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT)
    set_offsets(settings, "held", topic, to_offset=20, execute=True, reason="test")
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:  # as if the topic had been deleted and recreated with fewer records
        conn.execute(sa.text("UPDATE kstore_offsets SET next_offset = 1000 WHERE partition_id = 0"))
    engine.dispose()
    produce(topic, (f"n{i}" for i in range(5)), partition=1)
    w = workers(pg_dsn, topic, "held")
    w.wait_for_log(r"past the log end 20 \(topic recreated\?\): partition held")
    wait_until(lambda: len(effects(pg_dsn)) == 5, 30)
    time.sleep(1)
    assert {(t, p) for t, p, _ in effects(pg_dsn)} == {(topic, 1)}, "the held partition must not be consumed"
    assert any("partition held" in r for r in history_reasons(pg_dsn, "held"))

    r = kstore("offsets", "set", "--group", "held", "--topic", topic, "--partition", "0", "--to-earliest",
               "--reason", "topic was recreated", "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--execute")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: len(effects(pg_dsn)) == 25, 30, what="the held partition to be consumed after the reset")
    assert w.terminate() == 0


def test_retention_gap_warns_and_applies_start_policy(pg_dsn: str, kafka: str, admin: Any, new_topic: Any,
                                                      produce: Any, workers: Any) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(50)))
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT)
    set_offsets(settings, "gap", topic, to_offset=10, execute=True, reason="test")
    admin.delete_records({TopicPartition(topic, 0): 30})  # retention removed 0..29
    w = workers(pg_dsn, topic, "gap")
    w.wait_for_log(r"below the log start 30")
    wait_until(lambda: stored_offsets(pg_dsn, "gap")[(topic, 0)] == 50, 30)
    assert w.terminate() == 0
    assert "MESSAGES 10..29 WERE NEVER PROCESSED" in w.log
    assert set(effects(pg_dsn)) == {(topic, 0, o) for o in range(30, 50)}
    assert any("below the log start 30" in r for r in history_reasons(pg_dsn, "gap"))


def test_show_of_a_group_with_no_stored_offsets_names_the_groups_that_have(pg_dsn: str, kafka: str,
                                                                           new_topic: Any) -> None:
    """A typo in --group: one line naming the groups that do have stored offsets, exit 2 (not an
    empty table and exit 0), from `offsets show` and `top` alike."""
    topic = new_topic(partitions=1)
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT)
    with pytest.raises(ConfigurationError, match="no group has any yet"):
        show_offsets(settings, "orders")
    for group in ("payments", "orders"):
        set_offsets(settings, group, topic, to_earliest=True, execute=True, reason="test")
    for args in ([], ["--topic", topic], ["--json"]):
        r = kstore("offsets", "show", "--group", "ordres", "--dsn", pg_dsn, "--bootstrap-servers", kafka, *args)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert r.stdout == ""
        assert r.stderr.strip().splitlines() == [
            f"kstore: error: group 'ordres' has no stored offsets in {Settings(dsn=pg_dsn).safe_dsn} (a worker "
            "stores a partition's offset when it first claims it); groups that have some: orders, payments"], r.stderr
    top = kstore("top", "--once", "--group", "ordres", "--dsn", pg_dsn, "--bootstrap-servers", kafka)
    assert top.returncode == 2 and top.stdout == "", (top.returncode, top.stdout, top.stderr)
    assert top.stderr.strip().splitlines() == [r.stderr.strip()], top.stderr  # the same line as offsets show
    ok = kstore("offsets", "show", "--group", "orders", "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--json")
    assert ok.returncode == 0 and [row["next_offset"] for row in json.loads(ok.stdout)] == [0], ok.stderr
