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

from tests.support.harness import wait_until


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
