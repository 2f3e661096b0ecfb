"""Dead-letter topics: each dead letter is also produced, through the outbox in the transaction that
writes it, to the processor's dead-letter topic, so the topic holds each letter exactly once (with
Spring Kafka's ``kafka_dlt-*`` headers), across a SIGKILL of the worker; the database letters stay."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.harness import (
    assert_exactly_once,
    effects,
    outbox_rows,
    read_committed_records,
    stored_offsets,
    table_rows,
    wait_until,
)

pytestmark = pytest.mark.integration


#: Messages in all, and the bad among them: every fourth, of three kinds in turn (the error class each
#: letter names, and how many attempts it took).
MESSAGES, LETTERS = 4000, 1000
KINDS = {"not-json": ("kstore.retry.DeserializationError", 1), "reject": ("kstore.retry.Reject", 1),
         "crash": ("builtins.RuntimeError", 2)}


def test_each_dead_letter_reaches_its_topic_once_with_its_headers_across_a_kill(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """1,000 dead letters of 4,000 messages (a third each: not JSON, rejected, crashing every attempt),
    the worker SIGKILLed after some letters were written and before all."""
    source, dlt = new_topic(partitions=3), new_topic(partitions=2)
    values: list[bytes] = []
    bad: dict[int, str] = {}  # position -> its kind
    for n in range(MESSAGES):
        kind = list(KINDS)[n // 4 % 3] if n % 4 == 1 else "ok"
        values.append(b"{not json %d" % n if kind == "not-json" else json.dumps({"n": n, "kind": kind}).encode())
        if kind != "ok":
            bad[n] = kind
    assert len(bad) == LETTERS
    sent = produce(source, values)
    env = {"KSTORE_TEST_DLT_TOPIC": dlt}
    w1 = workers(pg_dsn, source, "lettered", "letter_processors:Lettered", env=env, args=["--max-batch-size", "200"])
    wait_until(lambda: table_rows(pg_dsn, "kstore_dead_letters") >= 100, 90, interval=0.2, what="some letters written")
    w1.kill()
    written = table_rows(pg_dsn, "kstore_dead_letters")
    assert written < LETTERS, "every letter was written before the worker was killed"
    w2 = workers(pg_dsn, source, "lettered", "letter_processors:Lettered", env=env, args=["--max-batch-size", "200"])
    ends: dict[tuple[str, int], int] = {}
    for t, p, o in sent:
        ends[(t, p)] = max(ends.get((t, p), 0), o + 1)
    wait_until(lambda: all((stored_offsets(pg_dsn, "lettered").get(tp) or 0) >= e for tp, e in ends.items()),
               180, interval=0.5, what="every message committed")

    good = {sent[i] for i in range(len(values)) if i not in bad}
    assert_exactly_once(effects(pg_dsn), good)
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        letters = {(r.topic, r.partition_id, r.offset): r.attempts for r in conn.execute(sa.text(
            'SELECT topic, partition_id, "offset", attempts FROM kstore_dead_letters'))}
    engine.dispose()
    assert set(letters) == {sent[i] for i in bad} and len(letters) == LETTERS

    wait_until(lambda: outbox_rows(pg_dsn) == 0, 90, interval=0.5, what="every letter's record published")
    records = read_committed_records(kafka, dlt)
    by_source = {}
    for r in records:
        headers = dict(r.headers)
        where = (headers["kafka_dlt-original-topic"].decode(),
                 int.from_bytes(headers["kafka_dlt-original-partition"], "big", signed=True),
                 int.from_bytes(headers["kafka_dlt-original-offset"], "big", signed=True))
        assert where not in by_source, f"{where} is in the dead-letter topic twice"
        by_source[where] = (r, headers)
    assert set(by_source) == set(letters), "a letter is missing from its topic, or one is extra"
    assert len(records) == LETTERS
    for i, kind in bad.items():
        record, headers = by_source[sent[i]]
        assert record.value == values[i], "the letter's record carries the original value"
        error, attempts = KINDS[kind]
        assert headers["kafka_dlt-exception-fqcn"].decode() == error
        assert letters[sent[i]] == attempts
        assert headers["kafka_dlt-original-consumer-group"] == b"lettered"
        assert int(headers["kstore_dlt-attempts"]) == letters[sent[i]]
        assert b"Traceback" in headers["kafka_dlt-exception-stacktrace"]
    assert w2.terminate() == 0
