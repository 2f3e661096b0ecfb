"""Failures and bad input: poison messages, retries, dead letters, outages, shutdown, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kstore import Message, Processor, Retry, RetryPolicy, Settings, Worker
from tests.integration.cli.test_cli import PASSWORD, assert_one_clear_line, kstore
from tests.support.harness import SUPPORT_DIR, assert_exactly_once, effects, read_in_flight, stored_offsets, wait_until
from tests.support.processors import effects as effects_table


def dead_letter_rows(dsn: str) -> list[Any]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT id, topic, partition_id, \"offset\", attempts, error, status, traceback FROM kstore_dead_letters"
        )).all()
    engine.dispose()
    return list(rows)


def test_poison_message_is_retried_then_dead_lettered_and_replayed_once(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic = new_topic(partitions=2)
    good = set(produce(topic, (f"v{i}" for i in range(500))))
    (poison,) = produce(topic, ["poison"], partition=1)
    good |= set(produce(topic, (f"w{i}" for i in range(499))))
    w = workers(pg_dsn, topic, "dlq", env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "3"])
    wait_until(lambda: dead_letter_rows(pg_dsn), 60, what="the poison message dead-lettered")
    wait_until(lambda: len(effects(pg_dsn)) >= 999, 60, what="the 999 good messages")
    time.sleep(1)
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), good)
    (row,) = dead_letter_rows(pg_dsn)
    assert (row.topic, row.partition_id, row.offset, row.attempts, row.status) == (*poison, 3, "dead")
    assert "ValueError: poison message" in row.error and "Traceback" in row.traceback
    assert stored_offsets(pg_dsn, "dlq")[(topic, 1)] > poison[2], "the offset moved past the dead letter"
    assert w.log.count(f"offset {poison[2]} failed (attempt") == 2

    listed = kstore("dead-letters", "list", "--group", "dlq", "--dsn", pg_dsn)
    assert listed.returncode == 0 and f"{topic}  1" in listed.stdout.replace("  1 ", "  1  "), listed.stdout
    shown = kstore("dead-letters", "show", str(row.id), "--dsn", pg_dsn)
    assert shown.returncode == 0 and "value: b'poison'" in shown.stdout and "traceback:" in shown.stdout

    env = {"KSTORE_TEST_FAIL_VALUE": "poison"}
    again = _kstore_env(env, "dead-letters", "replay", "processors:Recorder", "--group", "dlq", "--execute",
                        "--dsn", pg_dsn)
    assert again.returncode == 1 and "failed again" in again.stderr, again.stdout + again.stderr
    assert dead_letter_rows(pg_dsn)[0].status == "dead" and dead_letter_rows(pg_dsn)[0].attempts == 4
    fixed = kstore("dead-letters", "replay", "processors:Recorder", "--group", "dlq", "--execute", "--dsn", pg_dsn)
    assert fixed.returncode == 0 and "replayed 1," in fixed.stdout, fixed.stdout + fixed.stderr
    twice = kstore("dead-letters", "replay", "processors:Recorder", "--group", "dlq", "--dsn", pg_dsn,
                   "--id", str(row.id))
    assert twice.returncode == 0 and "replayed 0, skipped 1" in twice.stdout, twice.stdout
    assert_exactly_once(effects(pg_dsn), good | {poison})
    assert dead_letter_rows(pg_dsn)[0].status == "replayed"


def _kstore_env(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", *args], capture_output=True, text=True, timeout=120,
                          cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR), **env})


def test_undecodable_message_is_dead_lettered(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic = new_topic(partitions=1)
    good = set(produce(topic, (json.dumps({"n": i}) for i in range(20))))
    (bad,) = produce(topic, ["not json {"])
    good |= set(produce(topic, (json.dumps({"n": i}) for i in range(20, 40))))
    w = workers(pg_dsn, topic, "undecodable", processor="processors:JsonRecorder",
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: len(effects(pg_dsn)) >= 40 and dead_letter_rows(pg_dsn), 60)
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), good)
    (row,) = dead_letter_rows(pg_dsn)
    assert (row.offset, row.attempts) == (bad[2], 1) and "JSONDecodeError" in row.error


class RetriesTwice(Processor):
    value_format = "str"

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    def handle(self, msg: Message) -> None:
        self.calls[msg.offset] = self.calls.get(msg.offset, 0) + 1
        if msg.offset == 5 and self.calls[msg.offset] <= 2:
            raise Retry("not yet", delay=0.05)
        self.session.execute(effects_table.insert().values(
            topic=msg.topic, partition_id=msg.partition, kafka_offset=msg.offset, value=msg.value))


def test_retry_raised_twice_then_success_lands_once(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    topic = new_topic(partitions=1)
    sent = set(produce(topic, (f"v{i}" for i in range(20))))
    proc = RetriesTwice()
    proc.retry = RetryPolicy(max_attempts=3, backoff_s=10)  # Retry's own delay wins over the policy's 10 s
    w = Worker(proc, Settings(dsn=pg_dsn, bootstrap_servers=kafka, group="retry", topics=(topic,),
                              max_batch_size=10, session_timeout_ms=6000, heartbeat_interval_ms=1000))
    started = time.monotonic()
    w.run(idle_timeout=2)
    # Two of the policy's 10 s backoffs would take 20 s; Retry's own short delay takes well under that.
    assert time.monotonic() - started < 19
    assert_exactly_once(effects(pg_dsn), sent)
    # Retry inside the batch of 10 (rolled back; no attempt counted: the culprit was unknown),
    # Retry alone (attempt 1), then success alone.
    assert proc.calls[5] == 3
    assert all(n == 1 for o, n in proc.calls.items() if o >= 10), "later batches ran normally"


def test_database_outage_rides_through(postgresql_outage_proc: Any, pg_outage_dsn: str, new_topic: Any,
                                       produce: Any, workers: Any) -> None:
    """PostgreSQL stopped for 10 s mid-run (a server of its own): the worker waits, retries, and
    carries on; each message once."""
    pg_dsn = pg_outage_dsn
    topic = new_topic(partitions=3)
    producer = threading.Thread(target=lambda: [produce(topic, (f"v{i}-{j}" for j in range(50))) or time.sleep(0.1)
                                                for i in range(40)])
    w = workers(pg_dsn, topic, "outage", env={"KSTORE_TEST_BATCH_SLEEP": "0.02"})
    producer.start()
    wait_until(lambda: len(effects(pg_dsn)) >= 300, 60)
    postgresql_outage_proc.stop()
    time.sleep(10)
    postgresql_outage_proc.start()
    wait_until(lambda: _accepts_connections(pg_dsn), 60, what="PostgreSQL back up")
    producer.join(60)
    wait_until(lambda: len(effects(pg_dsn)) >= 2000, 90, what="all 2,000 effects after the outage")
    time.sleep(1)
    assert w.terminate() == 0, w.log[-3000:]
    counts = effects(pg_dsn)
    assert len(counts) == 2000 and set(counts.values()) == {1}
    assert "database error" in w.log and "retrying in" in w.log


def _accepts_connections(dsn: str) -> bool:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return True
    except sa.exc.OperationalError:
        return False
    finally:
        engine.dispose()


def test_sigterm_mid_batch_commits_it_and_exits_0(pg_dsn: str, new_topic: Any, produce: Any, workers: Any,
                                                 tmp_path: Path) -> None:
    topic = new_topic(partitions=2)
    sent = set(produce(topic, (f"v{i}" for i in range(400))))
    hang = tmp_path / "hang"
    w = workers(pg_dsn, topic, "term", args=["--max-batch-size", "20"], env={
        "KSTORE_TEST_HANG_AT": "40", "KSTORE_TEST_HANG_FILE": str(hang), "KSTORE_TEST_HANG_SECONDS": "2"})
    wait_until(hang.exists, 60, interval=0.01)
    in_flight = read_in_flight(hang)
    assert w.terminate() == 0
    assert in_flight <= set(effects(pg_dsn)), "the batch in flight finishes and commits"
    workers(pg_dsn, topic, "term")
    wait_until(lambda: len(effects(pg_dsn)) >= 400, 60)
    time.sleep(1)
    assert_exactly_once(effects(pg_dsn), sent)


def test_sigterm_past_the_shutdown_timeout_rolls_the_batch_back(pg_dsn: str, new_topic: Any, produce: Any,
                                                                workers: Any, tmp_path: Path) -> None:
    topic = new_topic(partitions=1)
    sent = set(produce(topic, (f"v{i}" for i in range(100))))
    hang = tmp_path / "hang"
    w = workers(pg_dsn, topic, "slowstop", args=["--max-batch-size", "10"], env={
        "KSTORE_TEST_HANG_AT": "30", "KSTORE_TEST_HANG_FILE": str(hang), "KSTORE_SHUTDOWN_TIMEOUT_S": "1"})
    wait_until(hang.exists, 60, interval=0.01)
    started = time.monotonic()
    assert w.terminate(timeout=30) == 0
    assert time.monotonic() - started < 15
    assert "did not finish within 1s" in w.log
    assert set(effects(pg_dsn)) == {(topic, 0, o) for o in range(30)}, "nothing of the aborted batch"
    assert stored_offsets(pg_dsn, "slowstop") == {(topic, 0): 30}
    workers(pg_dsn, topic, "slowstop")
    wait_until(lambda: len(effects(pg_dsn)) >= 100, 60)
    time.sleep(1)
    assert_exactly_once(effects(pg_dsn), sent)


def test_second_signal_exits_at_once_without_committing(pg_dsn: str, new_topic: Any, produce: Any,
                                                        workers: Any, tmp_path: Path) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(100)))
    hang = tmp_path / "hang"
    w = workers(pg_dsn, topic, "twice", args=["--max-batch-size", "10"], env={
        "KSTORE_TEST_HANG_AT": "50", "KSTORE_TEST_HANG_FILE": str(hang)})
    wait_until(hang.exists, 60, interval=0.01)
    w.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    w.proc.send_signal(signal.SIGTERM)
    assert w.wait(15) == 128 + signal.SIGTERM
    assert "second stop signal" in w.log
    assert set(effects(pg_dsn)) == {(topic, 0, o) for o in range(50)}
    assert stored_offsets(pg_dsn, "twice") == {(topic, 0): 50}


def test_older_migration_is_refused_with_a_clear_line(tmp_path: Path, kafka: str, new_topic: Any) -> None:
    topic = new_topic(partitions=1)
    dsn = f"sqlite:///{tmp_path / 'old.db'}"
    assert kstore("migrate", "--dsn", dsn, "--revision", "0001").returncode == 0
    r = kstore("worker", "processors:Recorder", "--dsn", dsn, "--bootstrap-servers", kafka, "--topic", topic)
    assert_one_clear_line(r, "is at migration 0001, need 0015", "kstore migrate")


def test_invalid_option_values_get_one_line(sqlite_dsn: str, kafka: str) -> None:
    r = kstore("worker", "processors:Recorder", "--max-batch-size", "many")
    assert_one_clear_line(r, "'many' is not a valid integer", "kstore worker --help")
    r = kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka,
               "--max-batch-size", "0", "--topic", "t")
    assert_one_clear_line(r, "max_batch_size must be positive")
    r = kstore("worker", "processors:Recorder", "--start-from", "yesterday")
    assert_one_clear_line(r, "start_from must be earliest, latest or an ISO 8601 time")


def test_password_never_reaches_the_worker_log(postgresql: Any, pg_dsn: str, new_topic: Any, produce: Any,
                                               workers: Any) -> None:
    info = postgresql.info
    with postgresql.cursor() as cur:
        cur.execute(f"CREATE ROLE kuser LOGIN SUPERUSER PASSWORD '{PASSWORD}'")
    postgresql.commit()
    dsn = f"postgresql+psycopg2://kuser:{PASSWORD}@{info.host}:{info.port}/{info.dbname}"
    topic = new_topic(partitions=1)
    produce(topic, ["a", "b", "c"])
    w = workers(dsn, topic, "secret")
    wait_until(lambda: len(effects(pg_dsn)) == 3, 60)
    assert w.terminate() == 0
    assert "kuser:***@" in w.log
    assert PASSWORD not in w.log
