"""A message that cannot be deserialized is that message's failure, found without running its batch:
dead-lettered at once in its batch's transaction (on_error=dead_letter), or the worker stops with the
stored offset just before it (on_error=stop). No batch is rolled back and narrowed down for it."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Message, Processor, ProcessorError, RetryPolicy, Settings, Worker
from tests.support.harness import assert_exactly_once, effects, stored_offsets
from tests.support.processors import effects as effects_table


class JsonCounting(Processor):
    """JSON values ``{"n": ...}``; counts how often each message is deserialized and handled. A value
    without ``"n"`` fails in handle() with a KeyError (a processor bug, retried)."""

    value_format = "json"
    retry = RetryPolicy(max_attempts=1)

    def __init__(self) -> None:
        self.deserialized: Counter[int] = Counter()
        self.handled: Counter[int] = Counter()

    def deserialize(self, key: bytes | None, value: bytes | None) -> tuple[Any, Any]:
        self.deserialized[json.loads(value)["n"] if value and value.startswith(b'{"n"') else -1] += 1
        return super().deserialize(key, value)

    def handle(self, msg: Message) -> None:
        self.handled[msg.offset] += 1
        self.session.execute(effects_table.insert().values(
            topic=msg.topic, partition_id=msg.partition, kafka_offset=msg.offset, value=str(msg.value["n"])))


def settings(pg_dsn: str, kafka: str, group: str, topic: str, on_error: str) -> Settings:
    return Settings(dsn=pg_dsn, bootstrap_servers=kafka, group=group, topics=(topic,), on_error=on_error,
                    session_timeout_ms=6000, heartbeat_interval_ms=1000)


def rolled_back(w: Worker, reason: str) -> float:
    value = w.metrics.registry.get_sample_value("kstore_batches_rolled_back_total",
                                                {"group": w.group, "reason": reason})
    return value or 0.0


def letters(dsn: str) -> dict[int, tuple[str, int]]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text('SELECT "offset", error, attempts FROM kstore_dead_letters')).all()
    finally:
        engine.dispose()
    return {r[0]: (r[1], r[2]) for r in rows}


def test_one_bad_json_among_thousands_is_dead_lettered_without_narrowing_the_batch_down(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, caplog: pytest.LogCaptureFixture) -> None:
    topic, n, bad = new_topic(partitions=1), 3000, 1500
    sent = produce(topic, [b"{not json" if i == bad else json.dumps({"n": i}) for i in range(n)])
    proc = JsonCounting()
    w = Worker(proc, settings(pg_dsn, kafka, "undecodable", topic, "dead_letter"))
    with caplog.at_level(logging.WARNING, logger="kstore"):
        w.run(idle_timeout=2)
    # Found without a rolled back batch: every message deserialized once, every good one handled once.
    assert rolled_back(w, "error") == 0
    assert set(proc.deserialized.values()) == {1} and sum(proc.deserialized.values()) == n
    assert set(proc.handled.values()) == {1} and sum(proc.handled.values()) == n - 1
    assert_exactly_once(effects(pg_dsn), {m for m in sent if m[2] != bad})
    (error, attempts), = letters(pg_dsn).values()
    assert list(letters(pg_dsn)) == [bad] and attempts == 1
    assert error.startswith("DeserializationError: JSONDecodeError: "), error
    assert stored_offsets(pg_dsn, "undecodable") == {(topic, 0): n}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("smaller batches" in m or "failed (attempt" in m for m in warnings), warnings
    assert [m for m in warnings if "dead-lettered" in m] == [
        f"dead-lettered {topic}[0] offset {bad} at once: {error}"]


def test_the_batch_failure_logged_is_the_handlers_not_a_neighbours_deserialization(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, caplog: pytest.LogCaptureFixture) -> None:
    topic = new_topic(partitions=1)
    values = [json.dumps({"n": i}) for i in range(50)]
    values[10], values[20] = "not json", json.dumps({"m": 20})  # undecodable; a KeyError in handle()
    sent = produce(topic, values)
    w = Worker(JsonCounting(), settings(pg_dsn, kafka, "blame", topic, "dead_letter"))
    with caplog.at_level(logging.WARNING, logger="kstore"):
        w.run(idle_timeout=2)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed and all("JSONDecodeError" not in m for m in failed), failed
    assert "KeyError: 'n'" in failed[0], failed
    assert_exactly_once(effects(pg_dsn), {m for m in sent if m[2] not in (10, 20)})
    found = letters(pg_dsn)
    assert sorted(found) == [10, 20]
    assert found[10][0].startswith("DeserializationError: JSONDecodeError"), found
    assert found[20][0] == "KeyError: 'n'", found


def test_with_on_error_stop_the_worker_stops_just_before_an_undecodable_message(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    topic, bad = new_topic(partitions=1), 60
    sent = produce(topic, ["{" if i == bad else json.dumps({"n": i}) for i in range(100)])
    w = Worker(JsonCounting(), settings(pg_dsn, kafka, "undecodable-stop", topic, "stop"))
    with pytest.raises(ProcessorError, match=rf"cannot deserialize {topic}\[0\] offset {bad}: "
                                             r"JSONDecodeError: .*its offset was not committed \(on_error=stop\)"):
        w.run(idle_timeout=10)
    assert rolled_back(w, "error") == 0
    assert stored_offsets(pg_dsn, "undecodable-stop") == {(topic, 0): bad}
    assert_exactly_once(effects(pg_dsn), {m for m in sent if m[2] < bad})
    assert letters(pg_dsn) == {}
