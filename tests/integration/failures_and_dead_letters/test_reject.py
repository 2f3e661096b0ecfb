"""Messages that can never succeed: `Reject` (or an error the retry policy gives up on) is
dead-lettered at once, without backoff; one that wrote nothing is dead-lettered inside its
batch's own transaction, so bad messages cost almost nothing. And an `async def` hook kstore
cannot run (only handle, handle_batch, setup and teardown may be async) is refused at start."""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa

from tests.support.harness import assert_exactly_once, effects, wait_until


def dead_letters(dsn: str, group: str) -> list[tuple[str, int, int, str]]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(  # type: ignore[misc]
                "SELECT topic, partition_id, \"offset\", error FROM kstore_dead_letters WHERE consumer_group = :g "
                "ORDER BY topic, partition_id, \"offset\""), {"g": group})]
    finally:
        engine.dispose()


def writers(dsn: str, table: str, column: str, value: str) -> list[str]:
    """The id of the transaction that committed each row of ``table`` whose ``column`` is ``value``."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(f"SELECT xmin::text FROM {table} WHERE {column} = :v"),
                                     {"v": value}).scalars())
    finally:
        engine.dispose()


def count_effects(dsn: str, topic: str) -> int:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            query = sa.text("SELECT count(*) FROM effects WHERE topic = :t")
            return int(conn.execute(query, {"t": topic}).scalar_one())
    finally:
        engine.dispose()


def test_rejected_messages_are_dead_lettered_in_the_batch_transaction(pg_dsn: str, new_topic: Any, produce: Any,
                                                                     workers: Any) -> None:
    topic, group = new_topic(2), "rejects"
    good = set(produce(topic, [f"ok{i}" for i in range(300)]))
    bad = produce(topic, [f"bad{i}" for i in range(5)])
    good |= set(produce(topic, [f"ok-after{i}" for i in range(100)]))
    w = workers(pg_dsn, topic, group, processor="processors:Validating", args=["--on-error", "dead_letter"])
    wait_until(lambda: len(dead_letters(pg_dsn, group)) == 5 and len(effects(pg_dsn)) >= len(good), 60,
               what="the good messages and 5 dead letters")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), good)
    assert [d[:3] for d in dead_letters(pg_dsn, group)] == sorted(bad)
    assert all(d[3].startswith("Reject: invalid value 'bad") for d in dead_letters(pg_dsn, group))
    # Each dead letter was committed by a transaction that also wrote good messages' effects: its batch's.
    letters = writers(pg_dsn, "kstore_dead_letters", "consumer_group", group)
    batches = set(writers(pg_dsn, "effects", "topic", topic))
    assert len(letters) == 5 and set(letters) <= batches, (letters, batches)
    assert w.log.count("at once: Reject") == 5
    assert "retrying" not in w.log and "failed (attempt" not in w.log  # no rollback, no isolation, no backoff


def test_a_message_rejected_after_writing_rolls_back_its_write_and_is_not_retried(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(1), "late-rejects"
    good = set(produce(topic, [f"ok{i}" for i in range(50)]))
    (late,) = produce(topic, ["late-bad"])
    good |= set(produce(topic, [f"ok-after{i}" for i in range(50)]))
    w = workers(pg_dsn, topic, group, processor="processors:Validating", args=["--on-error", "dead_letter"])
    wait_until(lambda: len(dead_letters(pg_dsn, group)) == 1 and len(effects(pg_dsn)) >= len(good), 60,
               what="the good messages and the dead letter")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), good)  # the rejected message's own row was rolled back
    assert [d[:3] for d in dead_letters(pg_dsn, group)] == [late]
    assert not re.search(r"failed \(attempt \d of \d+\).*; retrying", w.log)


def test_errors_the_policy_gives_up_on_are_final(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(1), "give-up"
    sent = produce(topic, ["ok1", "flaky", "ok2"])
    w = workers(pg_dsn, topic, group, processor="processors:Validating", args=["--on-error", "dead_letter"],
                env={"KSTORE_TEST_GIVE_UP_ON_VALUE_ERROR": "1"})
    wait_until(lambda: len(dead_letters(pg_dsn, group)) == 1 and len(effects(pg_dsn)) >= 2, 60,
               what="the dead letter")
    assert w.terminate() == 0
    assert dead_letters(pg_dsn, group)[0][3].startswith("ValueError: cannot parse 'flaky'")
    assert_exactly_once(effects(pg_dsn), {sent[0], sent[2]})
    assert "retrying" not in w.log


def test_bad_messages_cost_little(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """Bad messages at a rate of 20 in 20,000 cost no extra transaction: each is
    dead-lettered in its batch's transaction, with no failed batch, no retry in smaller batches
    and no backoff. Counted in committed transactions (not in time: the machine is shared)."""
    def drain(values: list[str], group: str) -> tuple[int, str]:
        topic = new_topic(4)
        produce(topic, values)
        # Batches of 500 (not 5,000): enough transactions for a retry in smaller batches to show.
        w = workers(pg_dsn, topic, group, processor="processors:Validating", args=["--on-error", "dead_letter"],
                    env={"KSTORE_MAX_BATCH_SIZE": "500"})
        expected = sum(1 for v in values if not v.startswith("bad"))
        wait_until(lambda: count_effects(pg_dsn, topic) >= expected, 120, interval=0.2, what=f"{expected} effects")
        assert w.terminate() == 0
        written = writers(pg_dsn, "effects", "topic", topic) + writers(pg_dsn, "kstore_dead_letters", "topic", topic)
        return len(set(written)), w.log

    n = 20_000
    clean, _ = drain([f"ok{i}" for i in range(n)], "clean")
    dirty, log = drain([f"bad{i}" if i % 1000 == 500 else f"ok{i}" for i in range(n)], "dirty")
    print(f"{n:,} clean: {clean} transactions; with {n // 1000} rejected: {dirty}")
    assert len(dead_letters(pg_dsn, "dirty")) == n // 1000 and log.count("at once: Reject") == n // 1000
    assert "a batch of" not in log and "retrying" not in log, "a bad message failed its batch"
    # Retrying a failed batch of 500 in halves commits ~11 more transactions per bad message (seen: 40 against 261);
    # the bound leaves room for batches that the timing cut differently.
    assert clean >= n // 500 and dirty <= 1.5 * clean + 10, (clean, dirty)
