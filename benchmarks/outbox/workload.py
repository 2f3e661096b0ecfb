"""The outbox benchmark's input: JSON messages, pre-filled or at a fixed rate (confluent-kafka,
which costs the shared machine less CPU per message than kafka-python), and the full read of an
output topic that the exactly-once check judges.
"""

from __future__ import annotations

import time
from collections import Counter

from confluent_kafka import Producer
from kafka import KafkaConsumer, TopicPartition

from ..workload import LATENCY_LINGER_MS
from .records import input_value


def _producer(bootstrap: str, linger_ms: int) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms, "acks": "all",
                     "queue.buffering.max.messages": 1_000_000})


def _send(producer: Producer, topic: str, i: int, partitions: int, size: int) -> None:
    while True:
        try:
            producer.produce(topic, value=input_value(i, size), partition=i % partitions)
            return
        except BufferError:  # the local queue is full: let deliveries drain it
            producer.poll(0.05)


def _flush(producer: Producer) -> None:
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} messages were not delivered to Kafka within 120 s")


def prefill(bootstrap: str, topic: str, partitions: int, messages: int, size: int) -> None:
    """Messages ``0 .. messages-1``, round-robin over the partitions, as fast as the broker takes them."""
    producer = _producer(bootstrap, linger_ms=20)
    for i in range(messages):
        _send(producer, topic, i, partitions, size)
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
            _send(producer, topic, sent, partitions, size)
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
