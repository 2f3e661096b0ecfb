"""Processors that produce to Kafka through kstore's outbox, run by the outbox tests in worker subprocesses.

The output topic comes from ``KSTORE_TEST_OUT_TOPIC``. Each input value is ``<key>:<anything>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence

import sqlalchemy as sa

from kstore import Message, Processor, Reject

metadata = sa.MetaData()
#: Per key, how many of its messages committed: the order their batches committed in.
key_counts = sa.Table(
    "key_counts", metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("n", sa.BigInteger, nullable=False),
)

UPSERT = sa.text("INSERT INTO key_counts (key, n) VALUES (:key, :count) "
                 "ON CONFLICT (key) DO UPDATE SET n = key_counts.n + excluded.n RETURNING n")


def copies(offset: int) -> int:
    """How many output records the message at ``offset`` produces: one or two."""
    return 1 + offset % 2


class Booker(Processor):
    """Counts each message against its key (the count's row lock orders the key's batches by
    commit) and produces ``copies(offset)`` records keyed by it, carrying that count ``n``.

    A ``read_committed`` reader must then see, per key, ``n`` = 1, 2, 3, ... in order, each
    with all its copies, once: exactly once and in commit order, across input partitions.
    ``KSTORE_TEST_BATCH_SLEEP``: seconds to sleep in each batch (to widen windows for kills).
    """

    group = "booker"
    value_format = "str"

    def setup(self) -> None:
        self.out = os.environ["KSTORE_TEST_OUT_TOPIC"]
        self.sleep = float(os.environ.get("KSTORE_TEST_BATCH_SLEEP", "0"))

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        keys = [m.value.split(":", 1)[0] for m in msgs]
        counts = Counter(keys)
        next_n = {}
        for key in sorted(counts):  # in key order: two batches never deadlock on the counts' rows
            end = self.session.execute(UPSERT, {"key": key, "count": counts[key]}).scalar_one()
            next_n[key] = end - counts[key] + 1
        for msg, key in zip(msgs, keys, strict=True):
            n = next_n[key]
            next_n[key] += 1
            for i in range(copies(msg.offset)):
                value = {"key": key, "n": n, "i": i, "src": [msg.topic, msg.partition, msg.offset]}
                self.produce(self.out, value, key=key, headers=[("n", str(n).encode())])
        if self.sleep:
            time.sleep(self.sleep)


def expected_outputs(sent: Sequence[tuple[str, int, int]]) -> Counter[tuple[str, int, int]]:
    """Each input message (topic, partition, offset) and how many records it must produce."""
    return Counter({tuple(s): copies(s[2]) for s in sent})


def check_outputs(records: Sequence[tuple[bytes | None, bytes]],
                  sent: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """Assert exactly once and per-key commit order of what a read_committed reader saw; per key, its count."""
    per_key: dict[str, list[tuple[int, int]]] = {}
    seen: Counter[tuple[str, int, int]] = Counter()
    for key, raw in records:
        value = json.loads(raw)
        assert key == value["key"].encode()
        per_key.setdefault(value["key"], []).append((value["n"], value["i"]))
        seen[tuple(value["src"])] += 1
    expected = expected_outputs(sent)
    missing = expected - seen
    extra = seen - expected
    assert not missing and not extra, f"{sum(missing.values())} records missing, {sum(extra.values())} extra: " \
                                      f"{list(missing.items())[:5]} {list(extra.items())[:5]}"
    for key, ns in per_key.items():
        assert ns == sorted(ns), f"key {key}: records out of commit order: {ns[:20]}"
        firsts = [n for n, i in ns if i == 0]
        assert firsts == list(range(1, len(firsts) + 1)), f"key {key}: counts not 1..N once each: {firsts[:20]}"
    return {k: len(v) for k, v in per_key.items()}


class Picky(Processor):
    """Produces each message's value to the output topic, except: ``no-partition`` goes to a
    partition the topic does not have, ``huge`` is 2 MB, ``unjson`` is a set (not JSON). Each of those
    must fail at produce(), be dead-lettered alone, and leave the rest published."""

    group = "picky"
    value_format = "str"
    on_error = "dead_letter"

    def setup(self) -> None:
        self.out = os.environ["KSTORE_TEST_OUT_TOPIC"]

    def handle(self, msg: Message) -> None:
        if msg.value == "no-partition":
            self.produce(self.out, msg.value, partition=9)
        elif msg.value == "huge":
            self.produce(self.out, b"x" * 2_000_000)
        elif msg.value == "unjson":
            self.produce(self.out, {1, 2})
        else:
            self.produce(self.out, msg.value, key=msg.value)


stock_metadata = sa.MetaData()
#: The shared state that concurrent handlers read and change: each order takes one from its product.
products = sa.Table(
    "products", stock_metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("stock", sa.BigInteger, nullable=False),
)

TAKE_ONE = sa.text("UPDATE products SET stock = stock - 1 WHERE id = :product RETURNING stock")


class StockKeeper(Processor):
    """``async def handle``, read-modify-write on shared rows: each order (value ``<product>``, its
    own key) takes one from its product's stock and produces the stock left, keyed by product.

    It awaits a random 0-``KSTORE_TEST_MAX_SLEEP_MS`` ms before the UPDATE and again between the
    UPDATE and ``produce()`` (a slow call each), so concurrent orders of one product interleave:
    per product, what a ``read_committed`` reader sees must be the stock going down one by one, as
    the database took it. ``"reject"`` in a value produces, then raises :class:`Reject` before the
    UPDATE (its record must be left out); ``"poison"`` raises after its UPDATE (the batch fails, is
    narrowed down, and the re-run, without it, is what is published)."""

    group = "stock-keeper"
    value_format = "str"
    key_format = "str"
    on_error = "dead_letter"
    max_concurrency = 16

    def setup(self) -> None:
        self.out = os.environ["KSTORE_TEST_OUT_TOPIC"]
        self.max_sleep = float(os.environ.get("KSTORE_TEST_MAX_SLEEP_MS", "2")) / 1000
        self.rng = random.Random()

    async def handle(self, msg: Message) -> None:
        product = msg.value.split(":", 1)[0]
        if "reject" in msg.value:
            self.produce(self.out, {"product": product, "stock_left": -1}, key=product)
            raise Reject(f"order {msg.key} rejected")
        await asyncio.sleep(self.rng.random() * self.max_sleep)
        left = await self.session.scalar(TAKE_ONE, {"product": product})
        await asyncio.sleep(self.rng.random() * self.max_sleep)
        if "poison" in msg.value:
            raise ValueError(f"order {msg.key} is poison")
        self.produce(self.out, {"product": product, "stock_left": left}, key=product)
