"""Avro orders in, Avro ``order-accepted`` events out, through a schema registry, exactly once.

Each message on the ``orders`` topic is an Avro ``OrderPlaced`` record in the Confluent wire format
(a zero byte, the schema's id in the registry, the Avro payload), written with version 1 of its
schema (id, customer, amount) or version 2 (a ``currency`` added, with a default of ``"EUR"``).
The worker reads every record as version 2 (``value_schema``): Avro resolves a version 1 record to
it, with the default, so ``msg.value`` is always an ``OrderPlaced`` dataclass with a currency.
``handle()`` records the order in ``accepted_orders`` and produces an Avro ``OrderAccepted`` event,
keyed by the order's id, whose schema kstore registers under ``order-accepted-value``.

As in payments.py, the row, the offsets and the event (in kstore's outbox) commit in one
transaction, and the worker's relay publishes the event once it committed: a crash or a restart
neither repeats nor loses an order, and a ``read_committed`` reader sees each event once. The row is
keyed by the order's id (``ON CONFLICT (order_id) DO NOTHING RETURNING``), so an operator's replay
accepts nothing twice and produces nothing again.

A record that is not in the wire format, or does not decode with the schema it names, never reaches
``handle()``: with ``on_error = "dead_letter"`` it is dead-lettered at once (``kstore dead-letters
list --group orders-avro``); so is an order ``handle()`` rejects (an amount that is not positive).

Run it: ``scripts/demo --pipeline orders-avro`` starts a broker and a schema registry, produces
orders with both schema versions and a few bad records, and runs this processor across a SIGKILL.
By hand, with the topics ``orders`` and ``order-accepted`` made::

    python -m kstore_devbroker start             # prints the broker's address
    python -m kstore_devbroker run-registry      # prints the registry's URL (needs Java 21+)
    kstore migrate
    kstore worker examples/orders_avro.py:OrderAcceptor --schema-registry-url URL
"""

from __future__ import annotations

import dataclasses
import json

from sqlalchemy import BigInteger, Column, MetaData, String, Table, text

from kstore import Message, Processor, Reject
from kstore.schemas import Avro

#: Version 1 of the orders' schema.
ORDER_PLACED_V1 = json.dumps({
    "type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [{"name": "id", "type": "long"},
               {"name": "customer", "type": "string"},
               {"name": "amount", "type": "double"}],
})
#: Version 2: a field added with a default, so a version 2 reader reads version 1 records too.
ORDER_PLACED_V2 = json.dumps({
    "type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [{"name": "id", "type": "long"},
               {"name": "customer", "type": "string"},
               {"name": "amount", "type": "double"},
               {"name": "currency", "type": "string", "default": "EUR"}],
})
#: The events' schema.
ORDER_ACCEPTED = json.dumps({
    "type": "record", "name": "OrderAccepted", "namespace": "shop",
    "fields": [{"name": "order_id", "type": "long"},
               {"name": "customer", "type": "string"},
               {"name": "total_cents", "type": "long"},
               {"name": "currency", "type": "string"}],
})

ACCEPTED_TOPIC = "order-accepted"


@dataclasses.dataclass
class OrderPlaced:
    """An order as read (``value_model``): the fields of ``ORDER_PLACED_V2``."""

    id: int
    customer: str
    amount: float
    currency: str = "EUR"


@dataclasses.dataclass
class OrderAccepted:
    """An event as produced: the fields of ``ORDER_ACCEPTED``."""

    order_id: int
    customer: str
    total_cents: int
    currency: str


# The application's table. Created by setup() (CREATE TABLE IF NOT EXISTS) so the example runs with
# one command; a real project creates it with its own migrations.
metadata = MetaData()
accepted_orders = Table(
    "accepted_orders",
    metadata,
    Column("order_id", BigInteger, primary_key=True),
    Column("customer", String(100), nullable=False),
    Column("total_cents", BigInteger, nullable=False),
    Column("currency", String(3), nullable=False),
)

# Works on PostgreSQL and SQLite (3.35+) alike.
ACCEPT = text(
    "INSERT INTO accepted_orders (order_id, customer, total_cents, currency) "
    "VALUES (:order_id, :customer, :total_cents, :currency) "
    "ON CONFLICT (order_id) DO NOTHING RETURNING order_id"
)


class OrderAcceptor(Processor):
    topics = ["orders"]
    group = "orders-avro"
    value_format = "avro"            # read through the registry (--schema-registry-url)
    value_schema = ORDER_PLACED_V2   # every record read as version 2, whichever version wrote it
    value_model = OrderPlaced        # msg.value is an OrderPlaced
    on_error = "dead_letter"         # as are records that do not decode: kstore never retries those
    produces = [ACCEPTED_TOPIC]
    output_schemas = {ACCEPTED_TOPIC: Avro(ORDER_ACCEPTED)}

    def setup(self) -> None:
        metadata.create_all(self.engine)

    def handle(self, msg: Message) -> None:
        order: OrderPlaced = msg.value
        if order.amount <= 0:
            raise Reject(f"order {order.id}: the amount must be positive, got {order.amount}")
        accepted = OrderAccepted(order_id=order.id, customer=order.customer,
                                 total_cents=round(order.amount * 100), currency=order.currency)
        if self.session.execute(ACCEPT, dataclasses.asdict(accepted)).first() is None:
            return  # accepted before: this is a replay; its event was produced then
        # Serialized with ORDER_ACCEPTED (output_schemas), published once this batch commits.
        self.produce(ACCEPTED_TOPIC, accepted, key=str(order.id))
