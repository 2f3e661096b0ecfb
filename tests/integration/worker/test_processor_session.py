"""What the README promises a processor's code, through real `kstore worker` processes: a
`session.commit()` in handle() only flushes, `defer_inserts = False` runs each INSERT at once, and
an overridden `deserialize()` is what handle() receives."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until

DEAD_LETTER = ["--on-error", "dead_letter", "--max-attempts", "1"]


def query(dsn: str, sql: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params).all())
    finally:
        engine.dispose()


def notes(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dead_letters(dsn: str) -> dict[int, str]:
    return {r[0]: r[1] for r in query(dsn, 'SELECT "offset", error FROM kstore_dead_letters')}


def test_session_commit_in_handle_only_flushes_and_a_later_failure_rolls_it_back(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """Right after `self.session.commit()` the row is invisible to any other connection (it commits
    with the batch's offsets), and a message that fails after its own commit leaves no row."""
    topic = new_topic(partitions=1)
    notes_file = tmp_path / "notes"
    sent = produce(topic, ["ok-0", "ok-1", "fail-2", "ok-3", "ok-4"], partition=0)
    w = workers(pg_dsn, topic, "own-commit", "promise_processors:CommitsItself",
                env={"KSTORE_TEST_NOTES": str(notes_file)}, args=DEAD_LETTER)
    wait_until(lambda: stored_offsets(pg_dsn, "own-commit").get((topic, 0)) == 5, 60, what="offset 5 stored")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), {m for m in sent if m[2] != 2})
    assert list(dead_letters(pg_dsn)) == [2] and "failed after its own commit" in dead_letters(pg_dsn)[2]
    seen = notes(notes_file)
    assert {n["offset"] for n in seen} == {0, 1, 2, 3, 4}
    assert all(n["visible_elsewhere"] == 0 for n in seen), seen


def test_defer_inserts_false_raises_an_inserts_error_where_it_is_called_sqlite(
    sqlite_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """The duplicate's IntegrityError is caught in handle() around its own INSERT, and the batch
    goes on and commits (SQLite keeps the transaction after a failed statement)."""
    topic = new_topic(partitions=1)
    notes_file = tmp_path / "notes"
    sent = produce(topic, ["a", "b", "a", "c"], partition=0)
    w = workers(sqlite_dsn, topic, "immediate", "promise_processors:Immediate",
                env={"KSTORE_TEST_NOTES": str(notes_file)}, args=DEAD_LETTER)
    wait_until(lambda: stored_offsets(sqlite_dsn, "immediate").get((topic, 0)) == 4, 60, what="offset 4 stored")
    assert w.terminate() == 0
    assert_exactly_once(effects(sqlite_dsn), set(sent))
    values = {r[0]: r[1] for r in query(sqlite_dsn, "SELECT kafka_offset, value FROM effects")}
    assert values == {0: "a:inserted", 1: "b:inserted", 2: "a:duplicate", 3: "c:inserted"}
    assert [(n["offset"], n["caught"]) for n in notes(notes_file)] == [(2, "IntegrityError")]
    assert not dead_letters(sqlite_dsn)


def test_defer_inserts_false_raises_an_inserts_error_where_it_is_called_postgresql(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """On PostgreSQL too the duplicate's IntegrityError reaches handle() at the INSERT's own call
    (the transaction is aborted then, so that message is dead-lettered; the others land once)."""
    topic = new_topic(partitions=1)
    notes_file = tmp_path / "notes"
    sent = produce(topic, ["a", "b", "a", "c"], partition=0)
    w = workers(pg_dsn, topic, "immediate", "promise_processors:Immediate",
                env={"KSTORE_TEST_NOTES": str(notes_file)}, args=DEAD_LETTER)
    wait_until(lambda: stored_offsets(pg_dsn, "immediate").get((topic, 0)) == 4, 60, what="offset 4 stored")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), {m for m in sent if m[2] != 2})
    assert list(dead_letters(pg_dsn)) == [2]
    caught = notes(notes_file)
    assert caught and {(n["offset"], n["caught"]) for n in caught} == {(2, "IntegrityError")}


def test_deferred_inserts_do_not_raise_where_they_are_called(
    sqlite_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """The contrast that makes the tests above mean something: with the default deferred INSERTs
    the same code never sees the IntegrityError in its try (it surfaces when the INSERT is sent)."""
    topic = new_topic(partitions=1)
    notes_file = tmp_path / "notes"
    sent = produce(topic, ["a", "b", "a", "c"], partition=0)
    w = workers(sqlite_dsn, topic, "deferred", "promise_processors:Deferred",
                env={"KSTORE_TEST_NOTES": str(notes_file)}, args=DEAD_LETTER)
    wait_until(lambda: stored_offsets(sqlite_dsn, "deferred").get((topic, 0)) == 4, 60, what="offset 4 stored")
    assert w.terminate() == 0
    assert not notes(notes_file)
    assert list(dead_letters(sqlite_dsn)) == [2]
    assert_exactly_once(effects(sqlite_dsn), {m for m in sent if m[2] != 2})


def test_an_overridden_deserialize_is_what_handle_receives(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    """handle() gets deserialize()'s key and value; a record deserialize() raises on is a failing
    message (here dead-lettered with deserialize()'s error), never skipped."""
    topic = new_topic(partitions=1)
    sent = produce(topic, [b"a=1;b=2"], partition=0, key=b"abc")
    sent += produce(topic, [b"broken"], partition=0, key=b"k")
    sent += produce(topic, [b"x=9"], partition=0, key=b"xyz")
    w = workers(pg_dsn, topic, "own-deserializer", "promise_processors:OwnDeserializer", args=DEAD_LETTER)
    wait_until(lambda: stored_offsets(pg_dsn, "own-deserializer").get((topic, 0)) == 3, 60, what="offset 3 stored")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), {m for m in sent if m[2] != 1})
    values = {r[0]: r[1] for r in query(pg_dsn, "SELECT kafka_offset, value FROM effects")}
    assert values == {0: 'cba|{"a": "1", "b": "2"}', 2: 'zyx|{"x": "9"}'}
    letters = dead_letters(pg_dsn)
    assert list(letters) == [1] and "ValueError: not key=value pairs: 'broken'" in letters[1], letters
