"""One test per defect found by a careful read of the engine, each against
real Kafka and a real database. Each failed on the code before its fix."""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Sequence
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
from kafka import TopicPartition

from kstore import Message, Processor, Settings, Worker
from kstore.engine import commands as kstore_cli
from kstore.engine.partitions import Owned, Partitions
from kstore.kafka.kafkapython.consumer import KafkaPythonSource
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
    """Defect 2: with a backlog on partition 0 and a poison message at the head of partition 1,
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


class SessionInHooks(Recorder):
    """Uses self.session where there is no batch: on_committed."""

    def setup(self) -> None:
        super().setup()
        self.hook_errors: list[str] = []

    def on_committed(self, msgs: Sequence[Message]) -> None:
        try:
            self.session.execute(sa.text("SELECT 1"))
        except Exception as exc:
            self.hook_errors.append(str(exc))
            raise


def test_the_session_outside_a_batch_is_a_clear_error_and_does_not_stall_the_pipeline(
        sqlite_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """Defect 5: self.session used in on_committed began a transaction on the worker's
    connection that nothing ended; every later batch failed ("already initialized a Transaction")."""
    topic = new_topic(1)
    sent = set(produce(topic, [f"v{i}" for i in range(300)]))
    processor = SessionInHooks()
    w = Worker(processor, Settings(dsn=sqlite_dsn, bootstrap_servers=kafka, group="hooks", topics=(topic,),
                                   max_batch_size=50, batch_linger_ms=0))
    w.run(idle_timeout=3)
    assert_exactly_once(effects(sqlite_dsn), sent)
    assert processor.hook_errors and "only exists inside handle()" in processor.hook_errors[0]


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
    """Defect 7: an OperationalError raised inside handle() and an error raised after it (the
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
    """Defect 7: while a failed message waited for its next attempt with records queued, the
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


def test_the_shutdown_alarm_repeats_after_the_first_timeout() -> None:
    """Defect 7: the SIGALRM timer fired once; a batch begun after it was no longer bounded."""

    class FakeWorker:
        busy = False

        def request_stop(self) -> None:
            pass

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    try:
        kstore_cli._install_signals(FakeWorker(), 5.0)  # type: ignore[arg-type]
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        handler(signal.SIGTERM, None)
        value, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 4 < value <= 5 and interval == 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in old.items():
            signal.signal(s, h)


def test_seek_pause_and_resume_skip_a_partition_kafka_no_longer_assigns(kafka: str, new_topic: Any,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Defect 7: kafka-python 3 raises on seek/pause/resume of an unassigned partition; Kafka can
    revoke one on its IO thread just before the worker acts on it, and the worker exited."""
    topic = new_topic(1)
    settings = Settings(bootstrap_servers=kafka)
    source = KafkaPythonSource(settings, "unassigned", [topic], "w-test")
    partitions = Partitions(settings, source)
    try:
        assert source.consumer.assignment() == set()  # it never joined: nothing is assigned to it
        with pytest.raises(ValueError, match="Unassigned partition"):  # what kafka-python does on its own
            source.consumer.seek(TopicPartition(topic, 0), 5)
        with caplog.at_level(logging.DEBUG, logger="kstore"):
            partitions.own((topic, 0), Owned(1, 5), 5)  # seek + resume: not assigned to this consumer
            assert partitions.generation((topic, 0)) is not None  # owned all the same, until Kafka says otherwise
            partitions.disown([(topic, 0)])  # released: paused
        assert partitions.generation((topic, 0)) is None
        for doing in ("seeking", "resuming", "pausing"):
            assert f"{topic}[0] is no longer assigned: not {doing} it" in caplog.text, caplog.text
    finally:
        source.close()


class BatchSizes(Processor):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.sizes.append(len(msgs))


def test_batches_linger_only_while_draining_a_backlog(sqlite_dsn: str, kafka: str, new_topic: Any,
                                                      produce: Any) -> None:
    """The batch linger keeps a backlog's transactions large, but must not delay a steady
    stream: after a small batch, what is queued goes at once (it used to wait the whole
    linger, 5 ms by default, for every message of a steady stream: p50 latency 12.6 ms
    against 9.9 ms without it in the benchmark)."""
    topic = new_topic(1)
    processor = BatchSizes()
    w = Worker(processor, Settings(dsn=sqlite_dsn, bootstrap_servers=kafka, group="linger", topics=(topic,),
                                   max_batch_size=10, batch_linger_ms=1500))
    w.start()
    try:
        def queue(n: int) -> None:
            produce(topic, [f"v{i}" for i in range(n)])
            want = w.partitions.queued() + n
            deadline = time.monotonic() + 60
            while w.partitions.queued() < want:
                w.fetch_once()
                w.step() if w.ledger.pending else None
                assert time.monotonic() < deadline, "records never queued"

        def timed_step() -> float:
            started = time.monotonic()
            assert w.step()
            return time.monotonic() - started

        queue(24)
        timed_step(), timed_step()  # two full batches: a backlog
        assert timed_step() >= 1.4, "a partial batch after full ones lingers for more"
        assert processor.sizes == [10, 10, 4]
        queue(3)
        assert timed_step() < 1.0, "after a small batch, a steady stream's messages go at once"
        assert processor.sizes == [10, 10, 4, 3]
    finally:
        w.close()
