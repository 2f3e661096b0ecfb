"""A message that fails is isolated from the rest of its batch, against real Kafka and a real database: in few
transactions beside another partition's backlog, when the error is the database's but the message caused it,
and without spinning while it waits for its next attempt."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import psutil
import pytest
import sqlalchemy as sa

from kstore import Message, Settings, Worker
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until
from tests.support.processors import Recorder

pytestmark = pytest.mark.integration


def dead_letter_offsets(dsn: str) -> list[tuple[str, int, int]]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(
                sa.text('SELECT topic, partition_id, "offset" FROM kstore_dead_letters ORDER BY id'))]
    finally:
        engine.dispose()


def test_poison_next_to_another_partitions_backlog_is_isolated_in_few_transactions(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """With a backlog on partition 0 and a poison message at the head of partition 1,
    isolation batches mixed both partitions: the poison was never tried alone while partition 0
    had records, and partition 0 committed one message per two transactions (~2,000 commits here)."""
    topic = new_topic(2)
    backlog = set(produce(topic, [f"a{i}" for i in range(1000)], partition=0))
    (poison,) = produce(topic, ["poison"], partition=1)
    after = set(produce(topic, [f"b{i}" for i in range(10)], partition=1))
    w = workers(pg_dsn, topic, "livelock", env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(backlog | after), 120, what="every good message")
    assert w.terminate() == 0
    assert dead_letter_offsets(pg_dsn) == [poison]
    assert_exactly_once(effects(pg_dsn), backlog | after)
    commits = len(re.findall(r"committed \d+ messages", w.log))
    assert commits < 60, f"{commits} transactions for 1,011 messages: isolation is not pinning the poison"


class FailsAfterHandle(Recorder):
    """On a poison message, breaks the batch's transaction in ways only seen after handle():
    a statement on a table that does not exist (an OperationalError on SQLite), or
    session.rollback() (the transaction is gone when the offsets are written)."""

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        super().handle_batch(msgs)
        for m in msgs:
            if m.value == "no-such-table":
                self.session.execute(sa.text("SELECT * FROM no_such_table"))
            if m.value == "rollback":
                self.session.rollback()

    def setup(self) -> None:
        super().setup()
        self.fail_value = None


def test_database_errors_caused_by_a_message_are_isolated_and_dead_lettered(
        sqlite_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """An OperationalError raised inside handle() and an error raised after it (the
    processor rolled the session back) were retried forever as a database outage, at full size."""
    topic = new_topic(1)
    good = set(produce(topic, [f"v{i}" for i in range(40)]))
    bad1 = produce(topic, ["no-such-table"])
    good |= set(produce(topic, [f"w{i}" for i in range(40)]))
    bad2 = produce(topic, ["rollback"])
    good |= set(produce(topic, [f"x{i}" for i in range(40)]))
    w = Worker(FailsAfterHandle(), Settings(dsn=sqlite_dsn, bootstrap_servers=kafka, group="after", topics=(topic,),
                                            on_error="dead_letter", max_attempts=1))
    started = time.monotonic()
    w.run(idle_timeout=3)
    assert time.monotonic() - started < 60
    assert dead_letter_offsets(sqlite_dsn) == bad1 + bad2
    assert_exactly_once(effects(sqlite_dsn), good)
    assert stored_offsets(sqlite_dsn, "after") == {(topic, 0): 122}


def test_a_retry_backoff_with_records_queued_sleeps_instead_of_spinning(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """While a failed message waited for its next attempt with records queued, the
    main loop spun at 100% CPU. Measured as CPU time over wall time of the worker process."""
    topic = new_topic(1)
    produce(topic, ["poison"] + [f"v{i}" for i in range(200)])
    w = workers(pg_dsn, topic, "spin", env={"KSTORE_TEST_FAIL_VALUE": "poison"}, args=["--max-attempts", "8"])
    w.wait_for_log(r"attempt 3 of 8")  # backoffs of 2 s and more from here on
    proc = psutil.Process(w.proc.pid)
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(3)
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    wall = time.monotonic() - t0
    w.kill()
    assert cpu / wall < 0.3, f"the worker used {cpu:.2f}s of CPU in {wall:.2f}s while waiting to retry"
