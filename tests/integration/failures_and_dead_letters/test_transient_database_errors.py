"""Contention in PostgreSQL is the database's, not a message's: a lock timeout, a deadlock and a
serialization failure, provoked for real against a `kstore worker`, make it retry the batch. With
``--on-error dead_letter --max-attempts 1`` a single attempt counted against the message would
dead-letter it: none is, and every effect lands exactly once."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until

CONTENDED = "promise_processors:Contended"
ONE_ATTEMPT = ["--on-error", "dead_letter", "--max-attempts", "1"]


@pytest.fixture
def counter(pg_dsn: str) -> Iterator[sa.Engine]:
    """``promise_counter``: rows 1 and 2 at n = 0; the engine for the test's own connections."""
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE promise_counter (id INT PRIMARY KEY, n INT NOT NULL)"))
        conn.execute(sa.text("INSERT INTO promise_counter VALUES (1, 0), (2, 0)"))
    yield engine
    engine.dispose()


def counts(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {r[0]: r[1] for r in conn.execute(sa.text("SELECT id, n FROM promise_counter"))}


def dead_letters(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text('SELECT "offset", error FROM kstore_dead_letters')).all())


def notes(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def waiting_on_a_lock(engine: sa.Engine, like: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q"),
            {"q": like}).scalar_one())


def test_a_lock_timeout_is_retried_not_counted_against_the_message(
    pg_dsn: str, counter: sa.Engine, new_topic: Callable[..., str], produce: Callable[..., Any],
    workers: Callable[..., Any], tmp_path: Path,
) -> None:
    """Another connection holds row 1 for a few seconds; the batch's UPDATE of it times out
    (lock_timeout 300 ms) again and again until the row is released."""
    topic = new_topic(partitions=1)
    notes_file = tmp_path / "notes"
    holder = counter.connect()
    holder.begin()
    holder.execute(sa.text("SELECT n FROM promise_counter WHERE id = 1 FOR UPDATE"))
    sent = produce(topic, ["a", "b", "c"], partition=0)
    w = workers(pg_dsn, topic, "contended", CONTENDED, args=ONE_ATTEMPT,
                env={"KSTORE_TEST_CONTEND": "lock", "KSTORE_TEST_LOCK_TIMEOUT_MS": "300",
                     "KSTORE_TEST_NOTES": str(notes_file)})
    try:
        w.wait_for_log(r"canceling statement due to lock timeout")
        time.sleep(3)  # a few more attempts meet the lock
    finally:
        holder.rollback()
        holder.close()
    wait_until(lambda: stored_offsets(pg_dsn, "contended").get((topic, 0)) == 3, 60, what="offset 3 stored")
    assert w.terminate() == 0
    assert len(notes(notes_file)) > 3  # the batch did meet the lock, more than once
    assert dead_letters(counter) == []
    assert counts(counter) == {1: 3, 2: 0}
    assert_exactly_once(effects(pg_dsn), set(sent))


def test_a_deadlock_is_retried_not_counted_against_the_message(
    pg_dsn: str, counter: sa.Engine, new_topic: Callable[..., str], produce: Callable[..., Any],
    workers: Callable[..., Any], tmp_path: Path,
) -> None:
    """The batch updates row 1 then row 2; the test's connection holds row 2, then asks for row 1
    (with a long deadlock_timeout of its own, so the server picks the batch as the victim)."""
    topic = new_topic(partitions=1)
    holder = counter.connect()
    holder.begin()
    holder.execute(sa.text("SET LOCAL deadlock_timeout = '30s'"))
    holder.execute(sa.text("UPDATE promise_counter SET n = n + 100 WHERE id = 2"))
    sent = produce(topic, ["a"], partition=0)
    w = workers(pg_dsn, topic, "contended", CONTENDED, args=ONE_ATTEMPT,
                env={"KSTORE_TEST_CONTEND": "deadlock", "KSTORE_TEST_NOTES": str(tmp_path / "notes")})
    try:
        wait_until(lambda: waiting_on_a_lock(counter, "%WHERE id = 2%"), 60, what="the batch waiting for row 2")
        # Blocks until the server ends the batch's transaction as the deadlock's victim.
        holder.execute(sa.text("UPDATE promise_counter SET n = n + 100 WHERE id = 1"))
        holder.commit()
    finally:
        holder.close()
    wait_until(lambda: stored_offsets(pg_dsn, "contended").get((topic, 0)) == 1, 60, what="offset 1 stored")
    assert w.terminate() == 0
    assert "deadlock detected" in w.log
    assert dead_letters(counter) == []
    assert counts(counter) == {1: 101, 2: 101}
    assert_exactly_once(effects(pg_dsn), set(sent))


def test_a_serialization_failure_is_retried_not_counted_against_the_message(
    pg_dsn: str, counter: sa.Engine, new_topic: Callable[..., str], produce: Callable[..., Any],
    workers: Callable[..., Any], tmp_path: Path,
) -> None:
    """The batch reads row 1 under REPEATABLE READ; the test updates it meanwhile; the batch's
    UPDATE of it then fails with SQLSTATE 40001."""
    topic = new_topic(partitions=1)
    notes_file, wait_file = tmp_path / "notes", tmp_path / "wait"
    wait_file.touch()
    sent = produce(topic, ["a"], partition=0)
    w = workers(pg_dsn, topic, "contended", CONTENDED, args=ONE_ATTEMPT,
                env={"KSTORE_TEST_CONTEND": "serialize", "KSTORE_TEST_NOTES": str(notes_file),
                     "KSTORE_TEST_WAIT_FILE": str(wait_file)})
    wait_until(lambda: any("snapshot" in n for n in notes(notes_file)), 60, what="the batch's snapshot")
    with counter.begin() as conn:
        conn.execute(sa.text("UPDATE promise_counter SET n = n + 100 WHERE id = 1"))
    wait_file.unlink()
    wait_until(lambda: stored_offsets(pg_dsn, "contended").get((topic, 0)) == 1, 60, what="offset 1 stored")
    assert w.terminate() == 0
    assert "could not serialize access due to concurrent update" in w.log
    assert dead_letters(counter) == []
    assert counts(counter) == {1: 101, 2: 0}
    assert_exactly_once(effects(pg_dsn), set(sent))
