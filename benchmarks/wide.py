"""Joining a group with many stored partitions: how long until they are claimed and the first message arrives.

The target: with 1,000 stored partitions, their offsets load in one round trip
and the first message is delivered within 1 second of assignment.

    .venv/bin/python -m benchmarks.wide [--partitions 1000] [--bootstrap-servers H:P] [--dsn URL]

It creates a topic with that many partitions, puts one message in each, stores an
offset for every partition (``kstore offsets set --to-earliest``), then starts a worker
and reports, from the moment Kafka assigned the partitions: when the claim (one
statement) and the seeks were done, and when the first message reached the processor.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from kstore import Processor, Settings, Worker, migrate
from kstore.ops.offsets import set_offsets

from .services import local_kafka, local_postgres_dsn


class _FirstMessage(Processor):
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.claimed_at: float | None = None
        self.first_at: float | None = None

    def on_assigned(self, partitions: list[tuple[str, int]]) -> None:
        self.claimed_at = self.claimed_at or time.monotonic()

    def handle_batch(self, msgs: Sequence[Any]) -> None:
        self.first_at = self.first_at or time.monotonic()
        self.seen += len(msgs)


class _AssignedAt(logging.Handler):
    """Notes when the worker logged Kafka's assignment (the start of the clock)."""

    at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and record.getMessage().startswith("assigned "):
            self.at = time.monotonic()


def measure(bootstrap: str, dsn: str, partitions: int) -> dict[str, float]:
    topic = group = f"wide-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    for p in range(partitions):
        producer.send(topic, b"x", partition=p)
    producer.flush()
    producer.close()
    settings = Settings(dsn=dsn, bootstrap_servers=bootstrap, group=group, topics=(topic,))
    migrate(settings)
    set_offsets(settings, group, topic, to_earliest=True, execute=True, reason="benchmarks.wide")

    processor = _FirstMessage(partitions)
    worker = Worker(processor, settings)
    clock = _AssignedAt()
    logging.getLogger("kstore.engine.worker").addHandler(clock)
    logging.getLogger("kstore.engine.worker").setLevel(logging.INFO)

    def stop_when_done() -> None:
        deadline = time.monotonic() + 120
        while processor.seen < partitions and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.request_stop()

    threading.Thread(target=stop_when_done, daemon=True).start()
    try:
        worker.run()
    finally:
        logging.getLogger("kstore.engine.worker").removeHandler(clock)
    if clock.at is None or processor.claimed_at is None or processor.first_at is None:
        raise RuntimeError("the worker never got its partitions or a message")
    return {"partitions": partitions, "claimed_s": processor.claimed_at - clock.at,
            "first_message_s": processor.first_at - clock.at, "messages": processor.seen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wide", description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap_servers or stack.enter_context(local_kafka())
        dsn = args.dsn or stack.enter_context(local_postgres_dsn())
        result = measure(bootstrap, dsn, args.partitions)
    print(f"{result['partitions']:,} stored partitions: claimed and sought {result['claimed_s']:.3f} s after "
          f"assignment, first message {result['first_message_s']:.3f} s after (target < 1 s); "
          f"{result['messages']:,} messages delivered")
    return 0 if result["first_message_s"] < 1.0 and result["messages"] == result["partitions"] else 1


if __name__ == "__main__":
    sys.exit(main())
