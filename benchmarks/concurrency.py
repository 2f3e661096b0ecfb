"""Concurrency inside a batch: ``python -m benchmarks.concurrency``.

Parallel-consumer's example, on one partition: 10,000 messages, each awaiting a uniform 0-5 ms
(a slow call per message), keys drawn from 10 and from 10,000 values. Side by side in one run:

- ``async``: ``async def handle`` that ``await asyncio.sleep(...)``, ``ordering = "key"``;
- ``sequential``: a plain ``def handle`` that ``time.sleep(...)``s, today's path.

Both write one row per message through the batch's session, and every run is checked exactly
once (one row per offset, the stored offset at the end). Each message sleeps the same time in
both (drawn from its offset), so the ratio compares like with like. The clock runs from the
first message handled to the commit of the last. ``--tiny`` runs 1,000 messages (the CI smoke
test); ``--bootstrap-servers``/``--dsn`` use running services instead of starting them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from kstore import Message, Processor, Settings, Worker, migrate

from .services import local_kafka, local_postgres

#: parallel-consumer's published figures for this example, the targets kstore's "key" ordering meets.
TARGETS_S = {10_000: 2.1, 10: 3.3}
MAX_SLEEP_S = 0.005

metadata = sa.MetaData()
effects = sa.Table("concurrency_effects", metadata,
                   sa.Column("grp", sa.String(64), nullable=False),
                   sa.Column("kafka_offset", sa.BigInteger, nullable=False),
                   sa.Column("k", sa.String(16)))


def sleep_of(offset: int) -> float:
    """The message's wait: uniform in [0, 5 ms), the same for every contender."""
    return random.Random(offset).random() * MAX_SLEEP_S


class _Timed(Processor):
    value_format = "bytes"

    def __init__(self, total: int) -> None:
        self.total, self.seen = total, 0
        self.first: float | None = None
        self.last: float | None = None
        self.done = threading.Event()

    def started(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def on_committed(self, msgs: Sequence[Message]) -> None:
        self.seen += len(msgs)
        if self.seen >= self.total:
            self.last = time.perf_counter()
            self.done.set()

    def row(self, msg: Message) -> dict[str, Any]:
        return {"grp": self.group, "kafka_offset": msg.offset, "k": msg.key.decode()}


class AsyncSleeper(_Timed):
    ordering = "key"

    async def handle(self, msg: Message) -> None:
        self.started()
        await asyncio.sleep(sleep_of(msg.offset))
        await self.session.execute(effects.insert(), self.row(msg))


class SequentialSleeper(_Timed):
    def handle(self, msg: Message) -> None:
        self.started()
        time.sleep(sleep_of(msg.offset))
        self.session.execute(effects.insert(), self.row(msg))


@dataclass
class Run:
    contender: str
    keys: int
    messages: int
    seconds: float
    rows: int
    distinct: int
    stored: int | None

    @property
    def exactly_once(self) -> bool:
        return self.rows == self.distinct == self.messages and self.stored == self.messages


def fill_topic(kafka: str, messages: int, keys: int) -> str:
    topic = f"conc-{keys}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    rng = random.Random(keys)
    producer = KafkaProducer(bootstrap_servers=kafka, linger_ms=5, acks="all")
    try:
        for _ in range(messages):
            producer.send(topic, key=f"k{rng.randrange(keys)}".encode(), value=b"x" * 100, partition=0)
        producer.flush()
    finally:
        producer.close()
    return topic


def run_one(cls: type[_Timed], name: str, kafka: str, dsn: str, topic: str, keys: int, messages: int) -> Run:
    group = f"{name}-{uuid.uuid4().hex[:8]}"
    processor = cls(messages)
    processor.group = group  # type: ignore[misc]
    worker = Worker(processor, Settings(dsn=dsn, bootstrap_servers=kafka, group=group, topics=(topic,)))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        if not processor.done.wait(600):
            raise RuntimeError(f"{name}: {processor.seen} of {messages} messages committed after 600 s")
    finally:
        worker.request_stop()
        thread.join(60)
    assert processor.first is not None and processor.last is not None
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows, distinct = conn.execute(sa.select(sa.func.count(), sa.func.count(sa.distinct(effects.c.kafka_offset)))
                                          .where(effects.c.grp == group)).one()
            stored = conn.execute(sa.text("SELECT next_offset FROM kstore_offsets WHERE consumer_group = :g"),
                                  {"g": group}).scalar()
    finally:
        engine.dispose()
    return Run(name, keys, messages, processor.last - processor.first, rows, distinct, stored)


@contextlib.contextmanager
def services(kafka: str | None, dsn: str | None) -> Iterator[tuple[str, str]]:
    with contextlib.ExitStack() as stack:
        if kafka is None:
            kafka = stack.enter_context(local_kafka())
        if dsn is None:
            dsn = stack.enter_context(local_postgres()).dsn
        yield kafka, dsn


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.concurrency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--tiny", action="store_true", help="1,000 messages: the CI smoke test")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures to OUT/concurrency.json")
    args = parser.parse_args(argv)
    messages = 1000 if args.tiny else args.messages
    runs: list[Run] = []
    with services(args.bootstrap_servers, args.dsn) as (kafka, dsn):
        migrate(Settings(dsn=dsn))
        metadata.create_all(sa.create_engine(dsn))
        for keys in (10_000, 10):
            topic = fill_topic(kafka, messages, keys)
            for cls, name in ((AsyncSleeper, "async"), (SequentialSleeper, "sequential")):
                run = run_one(cls, name, kafka, dsn, topic, keys, messages)
                runs.append(run)
                print(f"{name:>10} keys={keys:<6} {messages} msgs in {run.seconds:6.2f} s "
                      f"({messages / run.seconds:7.0f} msg/s) exactly once: {run.exactly_once}", flush=True)
    report = _report(runs, messages)
    for line in report["lines"]:
        print(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "concurrency.json").write_text(json.dumps(report, indent=2))
    return 0 if all(r.exactly_once for r in runs) else 1


def _report(runs: list[Run], messages: int) -> dict[str, Any]:
    lines, ratios = [], []
    for keys in (10_000, 10):
        a = next(r for r in runs if r.keys == keys and r.contender == "async")
        s = next(r for r in runs if r.keys == keys and r.contender == "sequential")
        ratio = s.seconds / a.seconds
        ratios.append({"keys": keys, "speedup": ratio})
        target = TARGETS_S[keys] * messages / 10_000
        lines.append(f"keys={keys}: async x{ratio:.1f} the sequential handler; {a.seconds:.2f} s "
                     f"(parallel-consumer's figure, scaled to {messages} messages: {target:.2f} s)")
    return {"messages": messages, "runs": [vars(r) | {"exactly_once": r.exactly_once} for r in runs],
            "ratios": ratios, "lines": lines}


if __name__ == "__main__":
    raise SystemExit(main())
