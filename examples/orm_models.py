"""An order-status projection written with SQLAlchemy ORM models.

Each message on the ``order-events`` topic is JSON like
``{"event_id": "e-17", "order_id": 5, "type": "created", "customer": "ada", "total_cents": 4200}``,
then ``{"event_id": "e-18", "order_id": 5, "type": "paid"}`` and later ``"shipped"``,
keyed by the order id (so one order's events stay in order in one partition).

``handle()`` uses the ORM as in any SQLAlchemy 2 application: ``self.session`` is an ORM
``Session`` (joined to the batch's transaction), new objects go in with
``session.add()``, existing ones are read with ``select()``/``session.get()`` and changed
in place; the session flushes them before the batch's offsets commit. The session is
kstore's: never ``commit()`` it (kstore commits; a ``commit()`` there only flushes),
``rollback()`` it (that ends the whole batch's transaction: catch errors around
``with self.session.begin_nested():``) or ``close()`` it (see examples/README.md).

Replays (``kstore offsets set --shift-by -N --execute``) run ``handle()`` again on events
already applied. Each applied event is recorded in ``order_events`` under its id, and an
event found there is skipped, so every event is applied once.

Run it (``python -m kstore_devbroker start`` prints the broker's address)::

    kstore migrate
    python examples/orm_models.py produce 300          # 300 orders: created, paid, most shipped
    kstore worker examples/orm_models.py:OrderProjection
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kstore import Message, Processor, Reject


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    customer: Mapped[str] = mapped_column(String(100))
    total_cents: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    paid_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    shipped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: How many events changed this order: each event counts once, also across replays.
    events: Mapped[int] = mapped_column(default=0)


class OrderEvent(Base):
    """Every event applied, by its id: what makes a replayed event a no-op."""

    __tablename__ = "order_events"

    event_id: Mapped[str] = mapped_column(String(100), primary_key=True)
    order_id: Mapped[int] = mapped_column(BigInteger, index=True)
    type: Mapped[str] = mapped_column(String(20))
    topic: Mapped[str] = mapped_column(String(255))
    partition: Mapped[int]
    offset: Mapped[int] = mapped_column(BigInteger)


#: The status each event moves an order to, and the events allowed before it.
NEXT = {"paid": ("created",), "shipped": ("paid",)}


class OrderProjection(Processor):
    topics = ["order-events"]
    group = "order-projection"
    value_format = "json"
    on_error = "dead_letter"

    def setup(self) -> None:
        # The application's tables (CREATE TABLE IF NOT EXISTS, for the example only: a real
        # project creates them with its own Alembic migrations).
        Base.metadata.create_all(self.engine)

    def handle(self, msg: Message) -> None:
        event = msg.value
        kind = event.get("type") if isinstance(event, dict) else None
        if kind not in ("created", "paid", "shipped") or not event.get("event_id") or event.get("order_id") is None:
            raise Reject(f"not an order event: {event!r}")  # before any read: dead-lettered in this batch
        if self.session.get(OrderEvent, event["event_id"]) is not None:
            return  # applied before: a replay
        when = msg.timestamp
        if kind == "created":
            order = Order(id=event["order_id"], customer=event["customer"], total_cents=event["total_cents"],
                          status="created", created_at=when, events=0)
            self.session.add(order)
        else:
            found = self.session.scalars(select(Order).where(Order.id == event["order_id"])).one_or_none()
            if found is None or found.status not in NEXT[kind]:
                # After a read, so the batch rolls back and is narrowed down to this message
                # first; then it is dead-lettered without retries.
                raise Reject(f"{kind} for order {event['order_id']} in state "
                             f"{found.status if found else 'unknown'}")
            order = found
            order.status = kind
            if kind == "paid":
                order.paid_at = when
            else:
                order.shipped_at = when
        order.events += 1
        self.session.add(OrderEvent(event_id=event["event_id"], order_id=event["order_id"], type=kind,
                                    topic=msg.topic, partition=msg.partition, offset=msg.offset))


if __name__ == "__main__":
    import json
    import os
    import sys

    from confluent_kafka import Producer

    if sys.argv[1:2] != ["produce"]:
        sys.exit("usage: python examples/orm_models.py produce [ORDERS]")
    producer = Producer({"bootstrap.servers": os.environ.get("KSTORE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")})
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    events = [{"order_id": i, "type": "created", "customer": f"cust-{i % 17}", "total_cents": 100 * i}
              for i in range(n)]
    events += [{"order_id": i, "type": "paid"} for i in range(n)]
    events += [{"order_id": i, "type": "shipped"} for i in range(n) if i % 4]
    for seq, e in enumerate(events):
        if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
            producer.flush()
        producer.produce("order-events", key=str(e["order_id"]).encode(),
                         value=json.dumps({"event_id": f"e-{seq}", **e}).encode())
    producer.flush()
    print(f"produced {len(events)} events for {n} orders to 'order-events'")
