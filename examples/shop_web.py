"""A web service that places orders and announces each on Kafka exactly once: the outbox pattern
with :mod:`kstore.outbox`, in a small Starlette app.

``POST /orders`` with ``{"customer": "c-7", "amount": 1250}`` (cents) stores the order and, in
the same database transaction, produces an ``order-placed`` record keyed by the customer. A relay
(``kstore relay --outbox shop-web``) publishes what committed, once: a ``read_committed`` reader
sees each placed order once, nothing of a request that failed, and one customer's orders in the
order their transactions committed (each carries the customer's running count ``n``).

Concurrent requests do not wait for each other on the outbox: a request's records are written in
its commit, into one of the outbox's 16 shards by key, so up to 16 requests commit records at once.

Run it (``python -m kstore_devbroker start`` prints the broker's address; ``pip install
'kstore[psycopg2]' starlette uvicorn``)::

    export KSTORE_DSN=postgresql+psycopg2://USER:PASSWORD@HOST/DB KSTORE_BOOTSTRAP_SERVERS=127.0.0.1:9092
    kstore migrate
    kstore topics create order-placed --partitions 3
    uvicorn --app-dir examples shop_web:app &       # the web service: its start sets the outbox up (16 shards)
    kstore relay --outbox shop-web &                 # the publisher (several may run; it waits for the service)
    curl -X POST localhost:8000/orders -d '{"customer": "c-7", "amount": 1250}'

``SHOP_ORDER_TOPIC`` names another output topic (the tests use their own).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kstore import Settings
from kstore.outbox import Outbox

TOPIC = os.environ.get("SHOP_ORDER_TOPIC", "order-placed")

metadata = sa.MetaData()
orders = sa.Table(
    "shop_orders", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("customer", sa.String(64), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("n", sa.Integer, nullable=False),
)
customers = sa.Table(
    "shop_customers", metadata,
    sa.Column("customer", sa.String(64), primary_key=True),
    sa.Column("orders", sa.Integer, nullable=False),
)
#: The customer's count, moved under its row lock: one customer's requests commit one after another.
COUNT = sa.text("INSERT INTO shop_customers (customer, orders) VALUES (:c, 1) "
                "ON CONFLICT (customer) DO UPDATE SET orders = shop_customers.orders + 1 RETURNING orders")

settings = Settings.from_env()
engine = sa.create_engine(settings.dsn, pool_size=20, max_overflow=20)
events = Outbox("shop-web", settings)


class BadOrder(ValueError):
    pass


def checked(body: Any) -> tuple[str, int]:
    """The order's customer and amount, or :class:`BadOrder`."""
    if not isinstance(body, dict):
        raise BadOrder("the body must be a JSON object")
    customer, amount = body.get("customer"), body.get("amount")
    if not isinstance(customer, str) or not customer or len(customer) > 64:
        raise BadOrder("customer must be a non-empty string of at most 64 characters")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise BadOrder("amount must be a positive integer (cents)")
    return customer, amount


def place(customer: str, amount: int) -> dict[str, Any]:
    """The order stored and announced in one transaction (run on a worker thread: it blocks)."""
    with Session(engine) as session, session.begin():
        n = session.execute(COUNT, {"c": customer}).scalar_one()
        order_id = session.execute(orders.insert().returning(orders.c.id),
                                   {"customer": customer, "amount": amount, "n": n}).scalar_one()
        placed = {"order": order_id, "customer": customer, "amount": amount, "n": n}
        events.produce(session, TOPIC, placed, key=customer)
    return placed


async def place_order(request: Request) -> JSONResponse:
    try:
        customer, amount = checked(await request.json())
    except (ValueError, BadOrder) as exc:  # not JSON, or not an order
        return JSONResponse({"error": str(exc)}, status_code=422)
    return JSONResponse(await run_in_threadpool(place, customer, amount), status_code=201)


@contextlib.asynccontextmanager
async def lifespan(_app: Starlette) -> AsyncIterator[None]:
    metadata.create_all(engine)
    events.setup(engine)  # the outbox's shards, before any request
    yield
    engine.dispose()


app = Starlette(routes=[Route("/orders", place_order, methods=["POST"])], lifespan=lifespan)
