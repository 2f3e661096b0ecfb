"""reset_offsets: locked, queue-flushing, persisted; the origin bug and every kind of target."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import EARLIEST, LATEST, InvalidOffsetError, Message, Processor, Settings, Worker
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until
from tests.support.processors import effects as effects_table

#: What the seam between the engine and a Kafka client promises: on each client.
pytestmark = [pytest.mark.contract, pytest.mark.usefixtures("kafka_client")]



class Gate(Processor):
    """Records every delivery (committed or not); can hold a batch open until released."""

    group = "resets"
    value_format = "str"

    def __init__(self, hold_first: bool = False) -> None:
        self.delivered: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.delivered.extend(m.offset for m in msgs)
        self.session.execute(effects_table.insert(), [
            {"topic": m.topic, "partition_id": m.partition, "kafka_offset": m.offset, "value": m.value} for m in msgs
        ])
        if not self.release.is_set():
            self.entered.set()
            self.release.wait(30)


def group_of(topic: str) -> str:
    return f"resets-{topic}"


def start(dsn: str, kafka: str, topic: str, proc: Processor, **kw: Any) -> tuple[Worker, threading.Thread]:
    """A worker in a thread, on the test's Kafka client (the ``kafka_client`` fixture sets it in the
    environment), in a group of the topic's own (the clients' runs of a test may overlap)."""
    settings = Settings(dsn=dsn, bootstrap_servers=kafka, topics=(topic,), session_timeout_ms=6000,
                        heartbeat_interval_ms=1000, kafka_client=os.environ["KSTORE_KAFKA_CLIENT"],
                        group=group_of(topic), **kw)
    w = Worker(proc, settings)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    return w, t


def stop(w: Worker, t: threading.Thread) -> None:
    w.request_stop()
    t.join(30)
    assert not t.is_alive()


def history(dsn: str) -> list[tuple[int | None, int | None, str]]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT from_offset, to_offset, reason FROM kstore_offset_history ORDER BY id"))
        out = [(r[0], r[1], r[2]) for r in rows]
    engine.dispose()
    return out


def test_reset_flushes_queued_messages_the_origin_bug(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """Messages queued in kstore, a batch in flight, reset to 50 from another thread:
    the next delivery is 50, held_offsets says 50, and nothing stale moves the offset back."""
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(100)))
    gate = Gate(hold_first=True)
    w, t = start(pg_dsn, kafka, topic, gate, max_batch_size=5, max_poll_records=100)
    assert gate.entered.wait(30), "first batch never arrived"
    assert gate.delivered == [0, 1, 2, 3, 4]
    assert w.partitions.queued() > 0, "the test needs messages queued in kstore when it resets"

    assert w.reset_offsets({(topic, 0): 50}) == {(topic, 0): 50}
    assert w.held_offsets == {(topic, 0): 50}
    assert stored_offsets(pg_dsn, group_of(topic)) == {(topic, 0): 50}

    gate.release.set()  # the in-flight batch (0-4) now tries to commit under the old epoch
    wait_until(lambda: stored_offsets(pg_dsn, group_of(topic))[(topic, 0)] == 100, 30, what="offset 100 stored")
    stop(w, t)

    assert gate.delivered[5] == 50, f"after the reset the next delivery must be 50, got {gate.delivered[5:10]}"
    assert gate.delivered[5:] == list(range(50, 100))
    assert_exactly_once(effects(pg_dsn), {(topic, 0, o) for o in range(50, 100)})
    # The stale in-flight batch never committed, so the stored offset only went 50 -> 100.
    assert [h[1] for h in history(pg_dsn)][-1] == 50


def test_reset_from_inside_the_handler(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(60)))

    class SelfReset(Gate):
        worker: Worker

        def handle_batch(self, msgs: Sequence[Message]) -> None:
            super().handle_batch(msgs)
            if msgs[0].offset == 0:
                self.worker.reset_offsets({(topic, 0): 30})

    proc = SelfReset()
    w, t = start(pg_dsn, kafka, topic, proc, max_batch_size=10, max_poll_records=60)
    proc.worker = w
    wait_until(lambda: stored_offsets(pg_dsn, group_of(topic)).get((topic, 0)) == 60, 30)
    stop(w, t)
    assert proc.delivered == list(range(10)) + list(range(30, 60))
    assert_exactly_once(effects(pg_dsn), {(topic, 0, o) for o in range(30, 60)})


def test_reset_targets_offset_datetime_earliest_latest(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    topic = new_topic(partitions=1)
    tp = (topic, 0)
    produce(topic, (f"a{i}" for i in range(20)))
    time.sleep(0.05)
    between = datetime.now(timezone.utc)
    time.sleep(0.05)
    produce(topic, (f"b{i}" for i in range(20)))
    gate = Gate()
    w, t = start(pg_dsn, kafka, topic, gate)
    try:
        wait_until(lambda: w.held_offsets.get(tp) == 40, 30, what="all 40 processed")

        def replay(target: Any, expect_from: int) -> None:
            gate.delivered.clear()
            assert w.reset_offsets({tp: target}) == {tp: expect_from}
            # The worker runs on: a batch of the replay may have committed already (what was delivered,
            # below, says where the replay began).
            assert expect_from <= w.held_offsets[tp] <= 40
            wait_until(lambda: w.held_offsets.get(tp) == 40, 30, what=f"replay from {expect_from}")
            assert gate.delivered == list(range(expect_from, 40))

        replay(25, 25)
        replay(between, 20)
        replay(EARLIEST, 0)
        gate.delivered.clear()
        assert w.reset_offsets([(tp, LATEST)]) == {tp: 40}
        produce(topic, ["c0"])
        wait_until(lambda: w.held_offsets.get(tp) == 41, 30)
        assert gate.delivered == [40]

        # Invalid: past the log end -> logged error, start policy (earliest) instead.
        gate.delivered.clear()
        with caplog.at_level(logging.ERROR, logger="kstore"):
            assert w.reset_offsets({tp: 10_000}) == {tp: 0}
        assert any("past the log end" in r.getMessage() for r in caplog.records)
        wait_until(lambda: w.held_offsets.get(tp) == 41, 30)
        assert gate.delivered == list(range(41))

        # A time after every record has no offset: invalid too.
        with pytest.raises(InvalidOffsetError, match="no record at or after"):
            w.reset_offsets({tp: datetime(2100, 1, 1, tzinfo=timezone.utc)}, strict=True)
        # Strict mode raises and moves nothing.
        with pytest.raises(InvalidOffsetError, match="past the log end"):
            w.reset_offsets({tp: 10_000}, strict=True)
        assert w.held_offsets == {tp: 41}
        assert stored_offsets(pg_dsn, group_of(topic)) == {tp: 41}
    finally:
        stop(w, t)
    reasons = [h[2] for h in history(pg_dsn)]
    assert any("past the log end" in r for r in reasons), reasons


def test_resets_racing_with_polls_lose_nothing(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """Resets from another thread at random moments, every fifth made to land while a poll() runs
    (after the poller noted the generation, before the records come back): after each one,
    deliveries run contiguously from its target; a record fetched around a reset is neither
    skipped nor delivered out of place."""
    import random

    topic = new_topic(partitions=1)
    tp = (topic, 0)
    produce(topic, (f"v{i}" for i in range(3000)))

    class Slow(Gate):
        def handle_batch(self, msgs: Sequence[Message]) -> None:
            self.batches.append([m.offset for m in msgs])
            time.sleep(0.002)

    proc = Slow()
    proc.batches = []  # type: ignore[attr-defined]
    w, t = start(pg_dsn, kafka, topic, proc, max_batch_size=20, max_poll_records=50, **short_fetch_wait())
    rng = random.Random(7)
    targets: list[int] = []
    try:
        wait_until(lambda: proc.batches, 30)  # type: ignore[attr-defined]
        racer = PollRacer(w, tp)
        for i in range(25):
            time.sleep(rng.uniform(0.0, 0.15))
            target = rng.randrange(0, 2900)
            if i % 5 == 0:  # and some certainly while a poll runs
                racer.reset_mid_poll(target)
            else:
                w.reset_offsets({tp: target})
            targets.append(target)
        # And while idle: the worker is then inside a waiting poll() when the reset seeks.
        for _ in range(8):
            wait_until(lambda: w.held_offsets.get(tp) == 3000, 60, what="the partition drained")
            time.sleep(rng.uniform(0.05, 0.3))
            target = rng.randrange(2500, 2990)
            w.reset_offsets({tp: target})
            targets.append(target)
        wait_until(lambda: w.held_offsets.get(tp) == 3000, 60, what="the partition drained after the last reset")
    finally:
        stop(w, t)

    assert len(racer.raced) >= 5, f"resets landed in only {len(racer.raced)} polls that returned records"
    pending = list(targets)
    expected_next: int | None = None
    for batch in proc.batches:  # type: ignore[attr-defined]
        assert batch == list(range(batch[0], batch[0] + len(batch))), f"a batch with a gap: {batch}"
        if expected_next is not None and batch[0] != expected_next:
            # Only a reset may make delivery jump, and only to its target (resets are taken in order;
            # some may pass with no delivery in between).
            assert batch[0] in pending, f"delivery jumped to {batch[0]} after {expected_next - 1}: not a reset target"
            del pending[: pending.index(batch[0]) + 1]
        expected_next = batch[-1] + 1
    assert expected_next == 3000


#: librdkafka keeps a fetch waiting at the broker (fetch.wait.max.ms, 500 ms by default) once it has
#: fetched to the log end, and fetches from a new position only after it answered: longer than the
#: poll that a reset lands in. Shorter here, so that each such poll can return records.
def short_fetch_wait() -> dict[str, Any]:
    return {"kafka_options": {"fetch.wait.max.ms": 50}} if os.environ["KSTORE_KAFKA_CLIENT"] == "confluent" else {}


class PollRacer:
    """Wraps the source's fetch (the Kafka client's ``poll()``/``consume()``, called once kstore has
    noted the generations) to count the polls that returned records while a reset landed (records
    kstore must drop, as fetched under the old generation, and seek the partition back to the
    reset's target: the client's position has moved past them). :meth:`reset_mid_poll` makes the
    next poll wait, in the poller's thread after kstore noted the generation, until a reset from the
    test's thread has landed. (Wrapped at the client's ``fetch``, the same moment for either client:
    confluent-kafka's consumer methods cannot be replaced.)"""

    def __init__(self, w: Worker, tp: TopicPartitionKey) -> None:
        self.w, self.tp = w, tp
        self.raced: list[int] = []  # records returned by each poll a reset landed in
        self._armed, self._lingering = threading.Event(), threading.Event()
        self._real_poll = w.source.fetch
        w.source.fetch = self._poll  # type: ignore[method-assign]

    def _poll(self, *args: Any, **kwargs: Any) -> Any:
        before = self.w.partitions.generation(self.tp)  # kstore noted the generation just before this call
        if self._armed.is_set():
            self._armed.clear()
            self._lingering.set()
            deadline = time.monotonic() + 5
            while self.w.partitions.generation(self.tp) == before and time.monotonic() < deadline:
                time.sleep(0.001)
        fetched = self._real_poll(*args, **kwargs)
        if fetched.records and self.w.partitions.generation(self.tp) != before:
            self.raced.append(sum(len(r) for _tp, r in fetched.records))
        return fetched

    def reset_mid_poll(self, target: int) -> None:
        self._lingering.clear()
        self._armed.set()
        assert self._lingering.wait(30), "the poller never polled"
        self.w.reset_offsets({self.tp: target})


def test_reset_landing_while_poll_runs_loses_nothing(pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """The worst interleaving, made deterministic: a reset completes after the poller noted the
    partition's generation and before poll() fetches from the new position. Those records are
    dropped as fetched under an older generation, so the partition must be sought back, not skipped."""
    topic = new_topic(partitions=1)
    tp = (topic, 0)
    produce(topic, (f"v{i}" for i in range(100)))
    gate = Gate()
    w, t = start(pg_dsn, kafka, topic, gate, max_batch_size=10, max_poll_records=10)
    try:
        wait_until(lambda: w.held_offsets.get(tp) == 100, 30, what="drained")
        source = w.source
        real_poll = source.fetch  # the client's poll, once kstore noted the generations
        injected: list[dict[TopicPartitionKey, int]] = []

        def poll_with_reset(*args: Any, **kwargs: Any) -> Any:
            if not injected:
                injected.append(w.reset_offsets({tp: 40}))
            return real_poll(*args, **kwargs)

        gate.delivered.clear()
        source.fetch = poll_with_reset  # type: ignore[method-assign]
        wait_until(lambda: injected and w.held_offsets.get(tp) == 100, 30, what="replayed from 40")
    finally:
        stop(w, t)
    assert injected == [{tp: 40}]
    assert gate.delivered == list(range(40, 100))


TopicPartitionKey = tuple[str, int]
