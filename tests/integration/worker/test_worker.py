"""The core engine against real Kafka and real PostgreSQL/SQLite."""

from __future__ import annotations

import threading
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from kstore import Settings, Worker
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
