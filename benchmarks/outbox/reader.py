"""The reader: a ``read_committed`` consumer of a contender's output topic, in a process of its own.

The same reader times every contender: confluent-kafka (librdkafka fetches on its own
thread, so the reader costs the shared machine little and is never late because of its own
work), ``isolation.level=read_committed``, every partition assigned from the beginning,
no group. It notes when each output record arrived (see :mod:`.records`) and stops once it
has seen a record for every input message. Whether each arrived exactly once is checked by
the parent afterwards, on a full read of the topic.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ..meter import Meter, signal_ready
from .records import Stamps, source_of

#: How long the broker may hold a fetch with nothing new to give. It answers at once when a
#: transaction's commit marker moves the last stable offset, so this only bounds the wait
#: when nothing happens; kept short so the reader never adds to what it measures.
FETCH_WAIT_MS = 10


def run(config: dict[str, Any], meter: Meter) -> None:
    consumer = Consumer({
        "bootstrap.servers": config["bootstrap"],
        "group.id": f"{config['group']}-reader",  # required by librdkafka; nothing is committed
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "fetch.wait.max.ms": FETCH_WAIT_MS,
    })
    stamps = Stamps()
    seen: set[tuple[int, int]] = set()
    repeated = 0
    try:
        consumer.assign([TopicPartition(config["topic"], p, OFFSET_BEGINNING) for p in range(config["partitions"])])
        ready = False
        while len(seen) < meter.expected:
            msgs = consumer.consume(num_messages=10_000, timeout=0.05)
            now = time.time_ns()
            if not ready:  # connected and fetching: the contender may start
                signal_ready(config.get("ready_file"))
                ready = True
            fresh = []
            for m in msgs:
                if m.error():
                    raise RuntimeError(f"reading {config['topic']}: {m.error()}")
                src = source_of(m.value() or b"")
                if src in seen:
                    repeated += 1
                else:
                    seen.add(src)
                    fresh.append(src)
            if fresh:
                meter.started()
                stamps.add(fresh, now)
                if meter.counted(len(fresh)):
                    meter.finished()
    finally:
        consumer.close()
    stamps.save(config["stamps_file"], repeated=repeated, last_ns=stamps.times[-1] if stamps.times else None)
