"""A batch in flight when its partition moves to another worker, on confluent-kafka: the revoke is
applied inside librdkafka's callback, so the batch sees its partition gone before it commits and
rolls back, rather than running its commit into the new owner's fence. Exactly once either way."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Message, Processor, Settings, Worker
from tests.support.harness import wait_until

pytestmark = pytest.mark.integration

GROUP = "revoke-in-flight"


class Held(Processor):
    """Writes each message; holds its first batch open until released."""

    group = GROUP
    value_format = "str"

    def __init__(self, hold: bool) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def setup(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS held_effects (kafka_offset BIGINT, worker TEXT)"))

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        for m in msgs:
            self.session.execute(sa.text("INSERT INTO held_effects VALUES (:o, :w)"),
                                 {"o": m.offset, "w": "held" if not self.release.is_set() else "free"})
        if not self.release.is_set():
            self.entered.set()
            assert self.release.wait(60), "the test never released the batch"


def owner(dsn: str, topic: str) -> str | None:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT owner FROM kstore_offsets WHERE topic = :t AND partition_id = 0"),
                                {"t": topic}).scalar()
    finally:
        engine.dispose()


def test_a_batch_whose_partition_moved_mid_batch_rolls_back_before_its_commit(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    topic = new_topic(partitions=1)

    def settings(client_id: str, poll_timeout_ms: int) -> Settings:
        return Settings(dsn=pg_dsn, bootstrap_servers=kafka, topics=(topic,), kafka_client="confluent",
                        rebalance_protocol="eager", client_id=client_id, session_timeout_ms=6000,
                        heartbeat_interval_ms=1000, poll_timeout_ms=poll_timeout_ms)

    # The old owner's fetch thread waits long inside consume() (nothing more comes for it): a revoke
    # applied only when consume() returns would land long after the batch commits.
    old_proc = Held(hold=True)
    old = Worker(old_proc, settings("z-old", 15_000))
    old_thread = threading.Thread(target=old.run, daemon=True)
    new: Worker | None = None
    new_thread: threading.Thread | None = None
    with caplog.at_level(logging.INFO, logger="kstore"):
        try:
            old_thread.start()
            wait_until(lambda: owner(pg_dsn, topic) == old.worker_id, 60, what="the old worker claimed the partition")
            produce(topic, ["m0"])
            assert old_proc.entered.wait(60), "the old worker never took the batch"
            # The eager protocol's range assignor gives the only partition to the member whose id sorts
            # first: the new worker's client id does. (Cooperative-sticky would leave it where it is.)
            new = Worker(Held(hold=False), settings("a-new", 500))
            new_thread = threading.Thread(target=new.run, daemon=True)
            new_thread.start()
            wait_until(lambda: owner(pg_dsn, topic) == new.worker_id, 60, what="the new worker claimed the partition")
            old_proc.release.set()
            wait_until(lambda: "no longer assigned here" in caplog.text or "epoch or offset moved" in caplog.text,
                       60, what="the old worker's batch ended")
            wait_until(lambda: new.held_offsets.get((topic, 0)) == 1, 60, what="the new worker committed m0")
        finally:
            old_proc.release.set()
            for w, t in ((new, new_thread), (old, old_thread)):
                if w is not None and t is not None:
                    w.request_stop()
                    t.join(60)
    said = [r.getMessage() for r in caplog.records if "fenced on" in r.getMessage()]
    assert any(f"{topic}[0], no longer assigned here" in line for line in said), said
    assert not any("epoch or offset moved" in line for line in said), said
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT kafka_offset, worker FROM held_effects")).all()
    engine.dispose()
    assert rows == [(0, "free")], "m0 must land once, by the new owner"
