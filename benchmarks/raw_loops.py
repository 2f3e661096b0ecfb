"""Contenders 1 and 2: consumer loops that read every message and do nothing with it.

They commit nothing (to Kafka or anywhere): they are the ceiling each client
reaches, against which kstore's own overhead is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer

from .meter import Meter, signal_ready


class _ReadyListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Signals readiness on assignment; runs on kafka-python's IO thread, so it only touches a file."""

    def __init__(self, ready_file: str | None) -> None:
        self.ready_file = ready_file

    def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            signal_ready(self.ready_file)

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass


def kafka_python_consumer(config: dict[str, Any]) -> Any:
    """A kafka-python consumer as a hand-written loop would make it: kafka-python's defaults,
    a fresh group from the start of the topic, no auto-commit (each loop decides what to commit)."""
    consumer = KafkaConsumer(
        bootstrap_servers=config["bootstrap"],
        group_id=config["group"],
        client_id=f"bench-{config['contender']}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    consumer.subscribe([config["topic"]], listener=_ReadyListener(config.get("ready_file")))
    return consumer


def kafka_python(config: dict[str, Any], meter: Meter) -> None:
    consumer = kafka_python_consumer(config)
    nbytes = 0
    try:
        while True:
            batches = consumer.poll(timeout_ms=1000)
            if not batches:
                continue
            meter.started()
            n = 0
            for records in batches.values():
                n += len(records)
                for record in records:  # read every message, as a real loop would
                    nbytes += len(record.value)
                if meter.latency:
                    meter.stamp(r.value for r in records)
            if meter.counted(n):
                meter.finished()
                return
    finally:
        consumer.close(autocommit=False)


def confluent(config: dict[str, Any], meter: Meter) -> None:
    from confluent_kafka import Consumer  # only this contender needs it

    ready_file = config.get("ready_file")
    consumer = Consumer({
        "bootstrap.servers": config["bootstrap"],
        "group.id": config["group"],
        "client.id": f"bench-{config['contender']}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    })
    consumer.subscribe([config["topic"]], on_assign=lambda _c, _parts: signal_ready(ready_file))
    fetch = _confluent_fetch(consumer, meter.latency)
    nbytes = 0
    try:
        while True:
            msgs = fetch()
            if not msgs:
                continue
            meter.started()
            for msg in msgs:
                if msg.error():
                    raise RuntimeError(f"confluent-kafka: {msg.error()}")
                nbytes += len(msg.value())
            if meter.latency:
                meter.stamp(m.value() for m in msgs)
            if meter.counted(len(msgs)):
                meter.finished()
                return
    finally:
        consumer.close()


def _confluent_fetch(consumer: Any, latency: bool) -> Callable[[], list[Any]]:
    """``consume(500)`` for throughput; ``poll()`` for latency, because ``consume(n)``
    waits until it has ``n`` messages or its timeout passed, which would add up to
    100 ms of waiting at 5,000 messages/s."""
    if not latency:
        return lambda: consumer.consume(num_messages=500, timeout=1.0)  # type: ignore[no-any-return]

    def one() -> list[Any]:
        msg = consumer.poll(1.0)
        return [] if msg is None else [msg]

    return one
