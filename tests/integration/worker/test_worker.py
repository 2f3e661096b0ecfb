"""The core engine against real Kafka and real PostgreSQL/SQLite."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from kstore import Message, Processor, Settings, Worker
from kstore.engine.partitions import Owned, Partitions
from kstore.kafka.kafkapython.consumer import KafkaPythonSource
from tests.conftest import KAFKA_CLIENT
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until
from tests.support.processors import Recorder


def make_worker(dsn: str, kafka: str, topic: str, group: str = "g1", processor: Any = None, **kw: Any) -> Worker:
    settings = Settings(dsn=dsn, bootstrap_servers=kafka, group=group, topics=(topic,),
                        session_timeout_ms=6000, heartbeat_interval_ms=1000, kafka_client=KAFKA_CLIENT, **kw)
    proc = processor or Recorder()
    if hasattr(proc, "setup") and not hasattr(proc, "name"):
        pass
    return Worker(proc, settings)


def test_in_process_worker_processes_every_message_once(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    topic = new_topic(partitions=4)
    sent = set(produce(topic, (f"v{i}" for i in range(200))))
    w = make_worker(pg_dsn, kafka, topic)
    w.run(idle_timeout=2)
    assert_exactly_once(effects(pg_dsn), sent)
    stored = stored_offsets(pg_dsn, "g1")
    assert stored == {(topic, p): 1 + max(o for _, pp, o in sent if pp == p) for p in range(4)}


def test_resume_continues_at_stored_offsets(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                            workers: Any) -> None:
    """Process part of a topic, stop (SIGTERM), produce more, restart: no duplicate and no gap."""
    topic = new_topic(partitions=3)
    first = set(produce(topic, (f"a{i}" for i in range(300))))
    w1 = workers(pg_dsn, topic, "resume")
    wait_until(lambda: len(effects(pg_dsn)) >= 300, 60, what="first 300 effects")
    assert w1.terminate() == 0
    second = set(produce(topic, (f"b{i}" for i in range(300))))
    w2 = workers(pg_dsn, topic, "resume")
    wait_until(lambda: len(effects(pg_dsn)) >= 600, 60, what="all 600 effects")
    assert w2.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | second)
    assert "claimed" in w2.log


def test_stored_offsets_win_over_kafka_committed(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """An offset committed to Kafka for the same group is ignored: the database decides."""
    topic = new_topic(partitions=1)
    sent = produce(topic, (f"v{i}" for i in range(100)))
    # Kafka says the group is at 90; nothing is stored yet, so kstore must start at 0 (earliest).
    c = KafkaConsumer(bootstrap_servers=kafka, group_id="win", enable_auto_commit=False)
    c.commit({TopicPartition(topic, 0): OffsetAndMetadata(90, "", -1)})
    c.close(autocommit=False)
    make_worker(pg_dsn, kafka, topic, group="win").run(idle_timeout=2)
    assert_exactly_once(effects(pg_dsn), set(sent))
    # And the other way round: the database says 40, Kafka says 90 -> reprocess from 40.
    produce(topic, (f"w{i}" for i in range(10)))
    import sqlalchemy as sa
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM effects WHERE kafka_offset >= 40"))
        conn.execute(sa.text("UPDATE kstore_offsets SET next_offset = 40 WHERE consumer_group = 'win'"))
    engine.dispose()
    make_worker(pg_dsn, kafka, topic, group="win").run(idle_timeout=2)
    assert_exactly_once(effects(pg_dsn), {(topic, 0, o) for o in range(110)})


def test_stop_from_another_thread(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    topic = new_topic(partitions=2)
    produce(topic, ["x"] * 10)
    w = make_worker(pg_dsn, kafka, topic)
    t = threading.Thread(target=w.run)
    t.start()
    wait_until(lambda: len(effects(pg_dsn)) == 10, 30)
    w.request_stop()
    t.join(30)
    assert not t.is_alive()


class CommitListener(Recorder):
    """Records what on_committed reports; the first batch holding offset 5 fails once (rolled back)."""

    def __init__(self) -> None:
        self.committed: list[tuple[str, int, int]] = []
        self.failed_once = False

    def handle_batch(self, msgs: Any) -> None:
        if not self.failed_once and any(m.offset == 5 for m in msgs):
            self.failed_once = True
            super().handle_batch(msgs)  # its writes land in the transaction, then it fails
            raise RuntimeError("rolled back once")
        super().handle_batch(msgs)

    def on_committed(self, msgs: Any) -> None:
        self.committed += [(m.topic, m.partition, m.offset) for m in msgs]


def test_on_committed_hears_each_committed_message_once(pg_dsn: str, kafka: str, new_topic: Any,
                                                        produce: Any) -> None:
    topic = new_topic(partitions=2)
    sent = set(produce(topic, (f"v{i}" for i in range(300))))
    proc = CommitListener()
    w = make_worker(pg_dsn, kafka, topic, processor=proc, max_batch_size=50)
    w.run(idle_timeout=2)
    assert proc.failed_once
    assert_exactly_once(effects(pg_dsn), sent)
    assert sorted(proc.committed) == sorted(sent), "every committed message once; the rolled-back batch not"


def test_a_first_assignment_is_announced_and_claimed_once(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                                          workers: Any) -> None:
    """A worker alone in a new group: one "assigned ...; claiming before any delivery" and one claim.
    kafka-python's group leader used to follow its first assignment with a second rebalance at
    once (its view of the topics' partitions dated from before it subscribed): the partitions were
    announced twice, and claimed twice, at most starts. Three groups one after another, so that a
    start that does it cannot slip through."""
    for n in range(3):
        topic = new_topic(partitions=2)
        produce(topic, [f"v{i}" for i in range(10)])
        w = workers(pg_dsn, topic, f"first-{n}")
        wait_until(lambda t=topic: sum(1 for tp in effects(pg_dsn) if tp[0] == t) == 10, 60,
                   what="the group's messages processed")
        assert w.terminate() == 0
        announced = [line for line in w.log.splitlines() if "claiming before any delivery" in line]
        assert len(announced) == 1, "\n".join(announced)
        assert f"assigned {topic}[0], {topic}[1]; claiming before any delivery" in announced[0]
        assert w.log.count("INFO kstore.engine.worker: claimed ") == 1, w.log


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


@pytest.mark.integration
def test_the_session_outside_a_batch_is_a_clear_error_and_does_not_stall_the_pipeline(
        sqlite_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """self.session used in on_committed began a transaction on the worker's
    connection that nothing ended; every later batch failed ("already initialized a Transaction")."""
    topic = new_topic(1)
    sent = set(produce(topic, [f"v{i}" for i in range(300)]))
    processor = SessionInHooks()
    w = Worker(processor, Settings(dsn=sqlite_dsn, bootstrap_servers=kafka, group="hooks", topics=(topic,),
                                   max_batch_size=50, batch_linger_ms=0))
    w.run(idle_timeout=3)
    assert_exactly_once(effects(sqlite_dsn), sent)
    assert processor.hook_errors and "only exists inside handle()" in processor.hook_errors[0]


@pytest.mark.integration
def test_seek_pause_and_resume_skip_a_partition_kafka_no_longer_assigns(kafka: str, new_topic: Any,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """kafka-python 3 raises on seek/pause/resume of an unassigned partition; Kafka can
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
            partitions.assign([(topic, 0)])
            partitions.own((topic, 0), Owned(1, 5), 5)  # seek + resume: not assigned to this consumer
            assert partitions.generation((topic, 0)) is not None  # owned all the same, until Kafka says otherwise
            partitions.revoke([(topic, 0)])  # released: paused
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


@pytest.mark.integration
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
