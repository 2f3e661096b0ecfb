"""What every contender reads and produces, and the times the children record.

Kept free of Kafka and database imports: every child loads it.

**Commit-to-visible latency** is measured the same way for every contender, from two files:

- the contender notes the wall-clock time (``time.time_ns()``) at which the database
  transaction holding each input message returned from COMMIT (kstore: in
  ``Processor.on_committed``, which the worker calls right after COMMIT returned; by hand:
  right after ``conn.commit()``), keyed by the message's (partition, offset);
- the reader, a ``read_committed`` consumer in a process of its own, notes the time each
  output record reached it, keyed by the (partition, offset) of the input message it came
  from (the record's value names it).

A record's latency is the difference. Neither time is written into the record, so no
contender pays for stamping or has its stamp taken at a point of its own choosing, and the
clock starts when the output *may* become visible (before COMMIT it must not) for all three.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Distinct keys of the input (and so of the output records).
KEYS = 1000


def input_value(i: int, size: int) -> bytes:
    """Message ``i`` of the input: a JSON object padded to about ``size`` bytes."""
    head = json.dumps({"id": i, "key": f"k{i * 7919 % KEYS}", "amount": i % 997, "note": ""}, separators=(",", ":"))
    pad = max(0, size - len(head))
    return (head[:-2] + "x" * pad + '"}').encode()


def output_record(partition: int, offset: int, value: bytes) -> tuple[bytes, bytes]:
    """The ``(key, value)`` every contender produces for an input message: keyed by the input's
    key, naming its source (``src``), so the reader and the exactly-once check can match them."""
    doc = json.loads(value)
    out = {"src": [partition, offset], "id": doc["id"], "key": doc["key"], "amount": doc["amount"]}
    return doc["key"].encode(), json.dumps(out, separators=(",", ":")).encode()


def source_of(value: bytes) -> tuple[int, int]:
    """The (partition, offset) of the input message an output record came from."""
    p, o = json.loads(value)["src"]
    return int(p), int(o)


class Stamps:
    """Times (``time.time_ns()``) per input message, kept in memory and saved once at the end."""

    def __init__(self) -> None:
        #: When the first batch of input was in hand: the start of the throughput clock.
        self.first_ns: int | None = None
        self.partitions: list[int] = []
        self.offsets: list[int] = []
        self.times: list[int] = []

    def started(self) -> None:
        if self.first_ns is None:
            self.first_ns = time.time_ns()

    def add(self, sources: Iterable[tuple[int, int]], now: int | None = None) -> None:
        """These input messages are done (committed, or their output seen) now."""
        at = time.time_ns() if now is None else now
        for p, o in sources:
            self.partitions.append(p)
            self.offsets.append(o)
            self.times.append(at)

    def save(self, path: str, **extra: Any) -> None:
        data = {"first_ns": self.first_ns, "p": self.partitions, "o": self.offsets, "t": self.times, **extra}
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


def load(path: Path) -> tuple[dict[str, Any], dict[tuple[int, int], int]]:
    """A saved :class:`Stamps`: its other fields, and ``{(partition, offset): ns}`` (the first time
    each source was stamped)."""
    data = json.loads(path.read_text())
    times: dict[tuple[int, int], int] = {}
    for p, o, t in zip(data.pop("p"), data.pop("o"), data.pop("t"), strict=True):
        times.setdefault((p, o), t)
    return data, times
