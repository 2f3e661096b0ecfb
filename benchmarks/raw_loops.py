"""Contender 1: a kafka-python loop that reads every message and does nothing with it.

It commits nothing (to Kafka or anywhere): it is the ceiling the client reaches,
against which kstore's own overhead is measured. Contender 2, the same loop on
confluent-kafka, is in ``confluent_loops``.
"""

from __future__ import annotations

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


def kafka_python_tuning(config: dict[str, Any]) -> dict[str, Any]:
    """The contender's ``KafkaConsumer`` options beyond the defaults: ``max_poll_records`` if tuned."""
    tuning = config.get("tuning", {})
    return {"max_poll_records": int(tuning["max_poll_records"])} if "max_poll_records" in tuning else {}


def kafka_python_consumer(config: dict[str, Any]) -> Any:
    """A kafka-python consumer as a hand-written loop would make it: kafka-python's defaults but
    for the contender's tuning, a fresh group from the start of the topic, no auto-commit (each
    loop decides what to commit)."""
    consumer = KafkaConsumer(
        bootstrap_servers=config["bootstrap"],
        group_id=config["group"],
        client_id=f"bench-{config['contender']}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **kafka_python_tuning(config),
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
