"""The harness itself: a real broker and a real PostgreSQL, end to end, without kstore's worker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kafka import KafkaConsumer

from tests.support.harness import assert_claimed_before_committed, wait_until


def test_kafka_to_postgres_round_trip(kafka: str, new_topic: Any, produce: Any, postgresql: psycopg.Connection) -> None:
    """1,000 messages on 4 partitions, consumed in a group and inserted: each row arrives once."""
    topic = new_topic(partitions=4)
    sent = produce(topic, (f"m{i}" for i in range(1000)))
    assert {p for _, p, _ in sent} == {0, 1, 2, 3}, "the producer should spread over all partitions"

    with postgresql.cursor() as cur:
        cur.execute("CREATE TABLE received (part int, off bigint, value text)")
    postgresql.commit()

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka, group_id="harness", auto_offset_reset="earliest",
                             enable_auto_commit=False)
    received = 0

    def drain() -> bool:
        nonlocal received
        for tp, records in consumer.poll(timeout_ms=500).items():
            with postgresql.cursor() as cur:
                cur.executemany("INSERT INTO received VALUES (%s, %s, %s)",
                                [(tp.partition, r.offset, r.value.decode()) for r in records])
            postgresql.commit()
            received += len(records)
        return received >= 1000

    try:
        wait_until(drain, timeout=60, interval=0, what="1,000 messages consumed")
    finally:
        consumer.close(autocommit=False)

    with postgresql.cursor() as cur:
        cur.execute("SELECT part, off, value FROM received")
        rows = cur.fetchall()
    counts = Counter((part, off) for part, off, _ in rows)
    assert len(rows) == 1000
    assert set(counts.values()) == {1}
    assert {(p, o) for _, p, o in sent} == set(counts)
    assert sorted(v for _, _, v in rows) == sorted(f"m{i}" for i in range(1000))


@pytest.mark.skipif(os.geteuid() != 0, reason="the servers run as postgres only when the tests run as root")
def test_another_pytest_session_leaves_this_sessions_postgresql_running(postgresql: psycopg.Connection,
                                                                         tmp_path: Path) -> None:
    """Any pytest session started without ``--basetemp`` (another project's, or a second run of
    these tests) resets ``/tmp/pytest-of-<user>`` to mode 0700. The servers run as ``postgres``: a
    data directory below that root could no longer be reached by ``pg_ctl`` (to stop it, to
    restart it mid-test, or to start the session's next server)."""
    with postgresql.cursor() as cur:
        cur.execute("SHOW data_directory")
        datadir = str(cur.fetchone()[0])  # type: ignore[index]
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_elsewhere.py").write_text("def test_in_a_temp_dir(tmp_path):\n    assert tmp_path.is_dir()\n")
    other = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                            str(tmp_path / "pytest.ini"), str(tmp_path / "test_elsewhere.py")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert other.returncode == 0, other.stdout + other.stderr
    # What pg_ctl needs (as postgres) to stop, restart or status the server: its data directory.
    reach = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-r", f"{datadir}/PG_VERSION"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert reach.returncode == 0, f"postgres can no longer reach {datadir}"
    with postgresql.cursor() as cur:
        cur.execute("CHECKPOINT")
        cur.execute("SELECT 1")
        assert cur.fetchone() == (1,)


def test_the_claim_check_lets_only_the_batch_in_flight_at_a_revoke_commit_after_it() -> None:
    """A revoke logged while a batch's last round trip is out: that batch may still commit the
    partition under the epoch it was held by; any other commit of it, or one under another epoch, fails."""
    def log(*lines: str) -> str:
        return "\n".join(f"2026-12-07 00:00:00,000 {line}" for line in lines)

    claimed = ("INFO kstore.engine.worker: claimed t[0]@0, t[1]@0",
               "DEBUG kstore.engine.worker: claim epochs: t[0]@4, t[1]@4",
               "DEBUG kstore.engine.batches: committed 2 messages: t[0]->1@4, t[1]->1@4",
               "INFO kstore.engine.worker: revoked t[1]")
    in_flight = "DEBUG kstore.engine.batches: committed 2 messages: t[0]->2@4, t[1]->2@4"
    assert assert_claimed_before_committed(log(*claimed, in_flight)) == 4
    with pytest.raises(AssertionError, match=r"committed \[\('t', 1\)\] without holding"):
        assert_claimed_before_committed(log(*claimed, in_flight.replace("t[1]->2@4", "t[1]->2@5")))
    with pytest.raises(AssertionError, match=r"committed \[\('t', 1\)\] without holding"):
        assert_claimed_before_committed(log(*claimed, in_flight, in_flight.replace("->2@", "->3@")))
    with pytest.raises(AssertionError, match=r"committed \[\('t', 2\)\] without holding"):
        assert_claimed_before_committed(log(claimed[0], "DEBUG kstore.engine.batches: committed 1 messages: t[2]->1@1"))
