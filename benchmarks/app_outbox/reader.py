"""The reader: a ``read_committed`` consumer of a phase's topic, in a process of its own
(``benchmarks.child``), the same for both contenders.

confluent-kafka (librdkafka fetches on its own thread, so the reader is never late because of its
own work), ``isolation.level=read_committed``, every partition assigned from the beginning, no
group, fetches held at most :data:`FETCH_WAIT_MS` by the broker. It notes when the record of each
order id first reached it and stops once it has seen all of them: the requests' number, or fewer
once the parent wrote how many committed into ``done_file``; or once nothing new came for
``idle_s`` after that (a record lost by the publish-after-commit loop never comes). Whether each
came exactly once is checked by the parent afterwards, on a full read of the topic.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ..meter import Meter, signal_ready
from .records import order_of, save

#: The broker answers a fetch at once when a commit marker moves the last stable offset (or a
#: plain record arrives): this only bounds the wait when nothing happens. Kept short so the
#: reader adds nothing to what it measures.
FETCH_WAIT_MS = 10


class _Seen:
    """The order ids read so far, when each first came, and how many came again."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.ids: list[int] = []
        self.times: list[int] = []
        self.repeated = 0

    def add(self, msgs: list[Any], now: int, topic: str) -> int:
        """Note a consume()'s records; returns how many orders were new."""
        fresh = 0
        for m in msgs:
            if m.error():
                raise RuntimeError(f"reading {topic}: {m.error()}")
            order = order_of(m.value() or b"")
            if order in self.seen:
                self.repeated += 1
            else:
                self.seen.add(order)
                self.ids.append(order)
                self.times.append(now)
                fresh += 1
        return fresh


def _committed(done_file: str) -> int | None:
    """How many requests committed, once the parent wrote it."""
    try:
        text = Path(done_file).read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.strip() else None


def run(config: dict[str, Any], meter: Meter) -> None:
    consumer = Consumer({
        "bootstrap.servers": config["bootstrap"],
        "group.id": f"{config['group']}-reader",  # required by librdkafka; nothing is committed
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "fetch.wait.max.ms": FETCH_WAIT_MS,
    })
    done_file, idle_s = config["done_file"], float(config["idle_s"])
    got = _Seen()
    last_new = time.monotonic()
    done_since: float | None = None
    try:
        consumer.list_topics(config["topic"], timeout=30)  # connected, the partitions' leaders known
        consumer.assign([TopicPartition(config["topic"], p, OFFSET_BEGINNING) for p in range(config["partitions"])])
        consumer.consume(num_messages=1, timeout=0.5)  # fetching (the topic is empty yet)
        signal_ready(config.get("ready_file"))
        while len(got.seen) < meter.expected:
            msgs = consumer.consume(num_messages=10_000, timeout=0.05)
            fresh = got.add(msgs, time.time_ns(), config["topic"])
            if fresh:
                last_new = time.monotonic()
                meter.started()
                if meter.counted(fresh):
                    meter.finished()
            elif done_since is None:
                committed = _committed(done_file)
                if committed is not None:
                    done_since, meter.expected = time.monotonic(), min(meter.expected, committed)
            elif time.monotonic() - max(last_new, done_since) > idle_s:
                break  # the rest never comes
    finally:
        consumer.close()
    meter.started()
    meter.finished()
    save(config["stamps_file"], {"ids": got.ids, "t": got.times, "repeated": got.repeated,
                                 "last_ns": got.times[-1] if got.times else None})
