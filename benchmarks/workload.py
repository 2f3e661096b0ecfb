"""The messages: topics, the pre-filled backlog and the fixed-rate producer.

Every value starts with its produce time (``time.time_ns()``, 19 ASCII digits)
so a consumer on the same machine can compute end-to-end latency from the
value alone, then a space and filler up to ``--size`` bytes. The producer is
confluent-kafka: it costs the (shared, 2-core) machine far less CPU per message
than kafka-python's, so it disturbs the contender less.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from confluent_kafka import Producer
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic

from .meter import STAMP_DIGITS

MIN_SIZE = STAMP_DIGITS + 1
#: librdkafka's default batching delay, so the latency phase sees batches the
#: way a real producer sends them. Shorter (1 ms) means one-record batches at
#: 5,000/s, which on 2 cores costs the broker and every consumer so much CPU
#: that the machine saturates and all contenders' tails grow; measured here:
#: broker CPU 4.1 s vs 2.4 s per 25,000 messages, raw kafka-python p50 70-800 ms vs ~10 ms.
LATENCY_LINGER_MS = 5


def make_value(size: int) -> bytes:
    """A ``size``-byte value stamped with the current time."""
    return b"%019d " % time.time_ns() + b"x" * (size - MIN_SIZE)


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()
    # The topic exists once every partition has a leader that answers ListOffsets.
    deadline = time.monotonic() + 60
    while True:
        try:
            end_offsets(bootstrap, topic, partitions)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def delete_topics(bootstrap: str, topics: Iterable[str]) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics(list(topics))
    finally:
        admin.close()


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    """``{partition: log end offset}`` as the broker reports it now."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return {tp.partition: offset for tp, offset in consumer.end_offsets(tps).items()}
    finally:
        consumer.close(autocommit=False)


def _producer(bootstrap: str, linger_ms: int) -> Producer:
    return Producer({
        "bootstrap.servers": bootstrap,
        "linger.ms": linger_ms,
        "acks": "all",
        "queue.buffering.max.messages": 1_000_000,
    })


def _send(producer: Producer, topic: str, value: bytes, partition: int) -> None:
    while True:
        try:
            producer.produce(topic, value=value, partition=partition)
            return
        except BufferError:  # the local queue is full: let deliveries drain it
            producer.poll(0.05)


def _flush(producer: Producer) -> None:
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} messages were not delivered to Kafka within 120 s")


#: Makes the next value, stamped with the current time (the Avro workload's: ``avro.AvroValues``).
Values = Callable[[], bytes]


def _values(size: int, values: Values | None) -> Values:
    return values if values is not None else lambda: make_value(size)


def prefill(bootstrap: str, topic: str, partitions: int, messages: int, size: int,
            values: Values | None = None) -> None:
    """Write ``messages`` values (``make_value(size)``, or ``values()``) round-robin over the partitions,
    as fast as the broker takes them."""
    producer = _producer(bootstrap, linger_ms=20)
    make = _values(size, values)
    for i in range(messages):
        _send(producer, topic, make(), i % partitions)
        if i % 10_000 == 0:
            producer.poll(0)
    _flush(producer)


def produce_at_rate(bootstrap: str, topic: str, partitions: int, messages: int, size: int, rate: float,
                    values: Values | None = None) -> float:
    """Send ``messages`` values (as :func:`prefill`) at ``rate`` per second (stamped as sent); returns
    the seconds it took.

    Paced on an absolute schedule (message ``i`` is due at ``start + i / rate``),
    so a slow tick is caught up rather than stretching the run. The measured
    latency includes up to ``LATENCY_LINGER_MS`` of the producer's batching,
    the same for every contender.
    """
    producer = _producer(bootstrap, linger_ms=LATENCY_LINGER_MS)
    make = _values(size, values)
    start = time.monotonic()
    sent = 0
    while sent < messages:
        due = min(messages, int((time.monotonic() - start) * rate) + 1)
        while sent < due:
            _send(producer, topic, make(), sent % partitions)
            sent += 1
        producer.poll(0)
        time.sleep(max(0.0, start + sent / rate - time.monotonic()))
    _flush(producer)
    return time.monotonic() - start
