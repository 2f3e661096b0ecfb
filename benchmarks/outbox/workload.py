"""The outbox benchmark's input: JSON messages, pre-filled or at a fixed rate (confluent-kafka,
which costs the shared machine less CPU per message than kafka-python), and the full read of an
output topic that the exactly-once check judges.
"""

from __future__ import annotations

import time
from collections import Counter

from kafka import KafkaConsumer, TopicPartition

from ..workload import LATENCY_LINGER_MS, _flush, _producer, _send
from .records import input_value


def prefill(bootstrap: str, topic: str, partitions: int, messages: int, size: int) -> None:
    """Messages ``0 .. messages-1``, round-robin over the partitions, as fast as the broker takes them."""
    producer = _producer(bootstrap, linger_ms=20)
    for i in range(messages):
        _send(producer, topic, input_value(i, size), i % partitions)
        if i % 10_000 == 0:
            producer.poll(0)
    _flush(producer)


def produce_at_rate(bootstrap: str, topic: str, partitions: int, messages: int, size: int, rate: float) -> float:
    """``messages`` at ``rate`` per second on an absolute schedule (a slow tick is caught up, not
    carried); returns the seconds it took. Batched as librdkafka does by default (the side-by-side
    benchmark's latency phase explains why)."""
    producer = _producer(bootstrap, linger_ms=LATENCY_LINGER_MS)
    start = time.monotonic()
    sent = 0
    while sent < messages:
        due = min(messages, int((time.monotonic() - start) * rate) + 1)
        while sent < due:
            _send(producer, topic, input_value(sent, size), sent % partitions)
            sent += 1
        producer.poll(0)
        time.sleep(max(0.0, start + sent / rate - time.monotonic()))
    _flush(producer)
    return time.monotonic() - start


Seen = Counter[tuple[bytes, bytes]]


def read_committed(bootstrap: str, topic: str, partitions: int, timeout_s: float = 300.0) -> Seen:
    """Every record a ``read_committed`` reader sees in ``topic`` up to its end, counted by (key, value)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False,
                             group_id=None, max_poll_records=10_000)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        seen: Seen = Counter()
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise RuntimeError(f"reading {topic} to its end took over {timeout_s:.0f} s")
            for records in consumer.poll(timeout_ms=500).values():
                seen.update((r.key, r.value) for r in records)
        return seen
    finally:
        consumer.close()
