"""What every request writes and produces, and the times the processes note about it.

Kept free of Kafka and database imports: the reader loads it too.

**Commit-to-readable latency**, the same way for both contenders, from two files:

- a request notes the wall-clock time (``time.time_ns()``) right after its COMMIT returned
  (leaving the ``with session.begin()`` block), keyed by its order id;
- the reader, a ``read_committed`` consumer in a process of its own, notes when the record
  naming that order id (``"order"`` in its JSON value) reached it.

A record's latency is the difference. Neither time is written into the record, so neither
contender pays for stamping, and the clock starts when the record *may* become readable
(before COMMIT it must not) for both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Distinct customers: the records' keys (and so the outbox shards and the topic's partitions).
CUSTOMERS = 1000


def customer_of(order: int) -> str:
    """The customer of order ``order`` (spread over :data:`CUSTOMERS`)."""
    return f"c{order * 7919 % CUSTOMERS}"


def order_event(order: int) -> dict[str, Any]:
    """The record a request produces for its order: the application's event, keyed by its customer."""
    return {"order": order, "customer": customer_of(order), "amount": 100 + order % 9_901}


def order_of(value: bytes) -> int:
    """The order id a record names."""
    return int(json.loads(value)["order"])


def save(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON at once (the parent never reads half a file)."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def load(path: str | Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(Path(path).read_text())
    return loaded
