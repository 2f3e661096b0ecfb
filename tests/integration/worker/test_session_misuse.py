"""What a processor may do to its session that kstore did not expect: close it (SQLAlchemy's
`with session as s:` habit) or roll it back. Neither may lose a write or hide what happened.
Here in a worker on Kafka and PostgreSQL; through ``run_batch`` on SQLite: tests/unit/db/test_session.py."""

from __future__ import annotations

import re
from typing import Any

from tests.support.harness import assert_exactly_once, effects, wait_until


def test_closing_the_session_in_a_worker_keeps_every_write(pg_dsn: str, new_topic: Any, produce: Any,
                                                           workers: Any) -> None:
    topic = new_topic(2)
    sent = set(produce(topic, [f"close{i}" for i in range(200)]))
    w = workers(pg_dsn, topic, "misuse-close", processor="processors:SessionMisuse")
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message written")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)


def test_a_session_rollback_in_handle_is_a_processor_failure_said_plainly(pg_dsn: str, new_topic: Any,
                                                                         produce: Any, workers: Any) -> None:
    """With INSERTs deferred it silently dropped the earlier messages' writes while their offsets
    committed; without, it ended the transaction and was reported as a lost COMMIT answer. Now it
    is the processor's failure, isolated and dead-lettered with a message that says what to do."""
    topic = new_topic(1)
    good = set(produce(topic, [f"ok{i}" for i in range(30)]))
    (bad,) = produce(topic, ["rollback"])
    good |= set(produce(topic, [f"ok-after{i}" for i in range(30)]))
    w = workers(pg_dsn, topic, "misuse-rollback", processor="processors:SessionMisuse",
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    w.wait_for_log("dead-lettered")
    wait_until(lambda: len(effects(pg_dsn)) >= len(good), 60, what="the other messages")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), good)
    # The rollback came in a batch with other messages: that batch failed whole, and their writes
    # landed (once) when it was retried in smaller batches.
    failed = [int(n) for n in re.findall(r"a batch of (\d+) failed \(BatchRollbackError", w.log)]
    assert failed and failed[0] > 1, w.log
    assert "lost its answer" not in w.log
    assert "BatchRollbackError: session.rollback() inside a batch would undo" in w.log
    assert f"offset {bad[2]}" in w.log.split("dead-lettered")[1].splitlines()[0]
