"""OpenTelemetry spans of a real worker (real broker, real PostgreSQL), with the SDK set up by
the processor's module as a user's would be, spans exported as JSON lines and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kafka import KafkaProducer

from tests.support.harness import assert_exactly_once, effects, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


def spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def produce_traced(kafka: str, topic: str, n: int) -> set[tuple[str, int, int]]:
    """n messages to partition 0; the first carries a producer's W3C traceparent."""
    producer = KafkaProducer(bootstrap_servers=kafka)
    try:
        futures = [producer.send(topic, f"v{i}".encode(), partition=0,
                                 headers=[("traceparent", f"00-{TRACE_ID}-{SPAN_ID}-01".encode())] if i == 0 else [])
                   for i in range(n)]
        producer.flush()
        return {(m.topic, m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)}
    finally:
        producer.close()


def test_a_span_per_batch_and_per_message_linked_to_the_producer(kafka: str, pg_dsn: str, new_topic: Any,
                                                                 workers: Any, tmp_path: Path) -> None:
    topic, out = new_topic(1), tmp_path / "spans.jsonl"
    sent = produce_traced(kafka, topic, 5)
    w = workers(pg_dsn, topic, "traced", processor="traced:TracedRecorder", env={"KSTORE_TEST_SPANS": str(out)})
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message processed")
    wait_until(lambda: len([s for s in spans(out) if s["parent_id"]]) >= 5, 10, what="the message spans")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)

    found = spans(out)
    batches = [s for s in found if s["attributes"].get("messaging.batch.message_count")]
    messages = [s for s in found if "messaging.kafka.offset" in s["attributes"]]
    assert batches and sum(b["attributes"]["messaging.batch.message_count"] for b in batches) == 5
    assert sorted(m["attributes"]["messaging.kafka.offset"] for m in messages) == [0, 1, 2, 3, 4]
    for span in batches + messages:
        assert span["kind"] == "SpanKind.CONSUMER" and span["name"] == f"process {topic}"
        a = span["attributes"]
        assert (a["messaging.system"], a["messaging.destination.name"], a["messaging.consumer.group.name"],
                a["messaging.operation.type"], a["messaging.destination.partition.id"]) == (
            "kafka", topic, "traced", "process", "0")
    batch_ids = {b["context"]["span_id"] for b in batches}
    assert all(m["parent_id"] in batch_ids for m in messages), "a message span outside its batch's span"
    first = next(m for m in messages if m["attributes"]["messaging.kafka.offset"] == 0)
    assert [(ln["context"]["trace_id"], ln["context"]["span_id"]) for ln in first["links"]] == [
        (f"0x{TRACE_ID}", f"0x{SPAN_ID}")]
    assert not any(m["links"] for m in messages if m is not first)
    assert any(ln["context"]["trace_id"] == f"0x{TRACE_ID}" for b in batches for ln in b["links"])


def test_a_processor_with_its_own_handle_batch_gets_batch_spans_only(kafka: str, pg_dsn: str, new_topic: Any,
                                                                    workers: Any, tmp_path: Path) -> None:
    topic, out = new_topic(1), tmp_path / "spans.jsonl"
    sent = produce_traced(kafka, topic, 3)
    w = workers(pg_dsn, topic, "traced-batch", processor="traced:TracedBatchRecorder",
                env={"KSTORE_TEST_SPANS": str(out)})
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message processed")
    wait_until(lambda: spans(out), 10, what="the batch spans")
    assert w.terminate() == 0
    found = spans(out)
    assert found and all("messaging.batch.message_count" in s["attributes"] for s in found)
