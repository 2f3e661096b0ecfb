"""Orders priced by an HTTP service, many calls at once, exactly once.

Each event on the ``orders`` topic is JSON like ``{"order": "o17", "sku": "A-1", "qty": 3}``,
keyed by customer. Pricing one order is an HTTP call that takes a few milliseconds; awaited one
by one, a partition would do a few hundred orders a second. ``async def handle`` lets kstore run
a batch's orders concurrently (up to ``max_concurrency``), one customer's orders still one after
another (``ordering = "key"``), and commit the batch once, with its offsets, when all are done.

The price service is any HTTP server answering ``GET /price/<sku>`` with ``{"price": 9.5}``
(``PRICES_URL``, default ``http://127.0.0.1:8000``). Needs ``pip install 'kstore[http]'`` (httpx).
Run it (after ``kstore migrate``)::

    PRICES_URL=http://127.0.0.1:8000 kstore worker enrich:OrderPricer --dsn postgresql+psycopg2://me@localhost/app
"""

from __future__ import annotations

import os

import httpx
from sqlalchemy import Column, Float, Integer, MetaData, String, Table

from kstore import Message, Processor

metadata = MetaData()
priced_orders = Table(
    "priced_orders",
    metadata,
    Column("order_id", String(64), primary_key=True),
    Column("customer", String(64)),
    Column("sku", String(64), nullable=False),
    Column("qty", Integer, nullable=False),
    Column("total", Float, nullable=False),
)


class OrderPricer(Processor):
    topics = ["orders"]
    group = "order-pricer"
    key_format = "str"
    value_format = "json"
    #: At most 32 calls in flight per worker: what the price service is sized for.
    max_concurrency = 32

    def setup(self) -> None:
        metadata.create_all(self.engine)
        # One client for the worker's life: it keeps its connections open between batches (kstore
        # runs every batch on the same event loop).
        self.prices = httpx.AsyncClient(base_url=os.environ.get("PRICES_URL", "http://127.0.0.1:8000"),
                                        timeout=5.0)

    async def handle(self, msg: Message) -> None:
        order = msg.value
        answer = await self.prices.get(f"/price/{order['sku']}")
        answer.raise_for_status()  # a failed call fails the batch: it is retried, then dead-lettered
        total = answer.json()["price"] * order["qty"]
        # The batch's one transaction, shared by its concurrent handlers: always `await` it.
        await self.session.execute(priced_orders.insert(), {
            "order_id": order["order"], "customer": msg.key, "sku": order["sku"], "qty": order["qty"],
            "total": total,
        })

    async def teardown(self) -> None:
        await self.prices.aclose()
