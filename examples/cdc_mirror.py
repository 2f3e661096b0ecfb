"""A change-data mirror: a table kept equal to the latest state of each key on a topic.

Each message on the ``customers-cdc`` topic is keyed by the row's primary key; its value
is the row as JSON (``{"name": "Ada", "email": "ada@example.com", "plan": "pro"}``), or
nothing at all (a tombstone, ``value is None``) when the row was deleted. This is what a
Debezium-style connector or a compacted topic gives you.

``handle()`` upserts the row, or deletes it for a tombstone. Each message carries the
row's whole new state (not a change to add), and Kafka keeps a key's messages in order in
one partition, so applying a message twice in a row changes nothing: a replay
(``kstore offsets set --shift-by -N --execute``) re-applies the last N changes in order and
the table ends exactly where it was. The row also records which message wrote it
(``source_partition``, ``source_offset``), for tracing a row back to the log.

Run it (``python -m kstore_devbroker start`` prints the broker's address)::

    kstore migrate
    python examples/cdc_mirror.py produce 1000       # inserts, updates and deletes of 100 keys
    kstore worker examples/cdc_mirror.py:CustomerMirror
"""

from __future__ import annotations

from sqlalchemy import text

from kstore import Message, Processor, Reject

# The application's table. Created by setup() (CREATE TABLE IF NOT EXISTS) so the example
# runs with one command; a real project creates it with its own migrations.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS customers_mirror ("
    " id VARCHAR(100) PRIMARY KEY, name VARCHAR(200), email VARCHAR(200), plan VARCHAR(50),"
    " source_partition INTEGER NOT NULL, source_offset BIGINT NOT NULL)"
)

UPSERT = text(
    "INSERT INTO customers_mirror (id, name, email, plan, source_partition, source_offset) "
    "VALUES (:id, :name, :email, :plan, :source_partition, :source_offset) "
    "ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name, email = EXCLUDED.email, plan = EXCLUDED.plan, "
    "source_partition = EXCLUDED.source_partition, source_offset = EXCLUDED.source_offset"
)
DELETE = text("DELETE FROM customers_mirror WHERE id = :id")

COLUMNS = ("name", "email", "plan")


class CustomerMirror(Processor):
    topics = ["customers-cdc"]
    group = "customers-mirror"
    key_format = "str"
    value_format = "json"
    on_error = "dead_letter"

    def setup(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(SCHEMA))

    def handle(self, msg: Message) -> None:
        if msg.key is None:
            raise Reject("no key: a change must be keyed by the row's primary key")
        if msg.value is None:  # tombstone: the row was deleted (deleting it again is a no-op)
            self.session.execute(DELETE, {"id": msg.key})
            return
        if not isinstance(msg.value, dict):
            raise Reject(f"a row must be a JSON object, got {msg.value!r}")
        row = {c: msg.value.get(c) for c in COLUMNS}
        self.session.execute(UPSERT, {"id": msg.key, **row, "source_partition": msg.partition,
                                      "source_offset": msg.offset})


if __name__ == "__main__":
    import json
    import os
    import random
    import sys

    from confluent_kafka import Producer

    if sys.argv[1:2] != ["produce"]:
        sys.exit("usage: python examples/cdc_mirror.py produce [N]")
    producer = Producer({"bootstrap.servers": os.environ.get("KSTORE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")})
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    rng = random.Random(7)
    for _ in range(n):
        if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
            producer.flush()
        key = f"c-{rng.randrange(100)}"
        value = None if rng.random() < 0.1 else json.dumps(
            {"name": f"Customer {key}", "email": f"{key}@example.com", "plan": rng.choice(["free", "pro", "team"])})
        producer.produce("customers-cdc", key=key.encode(), value=None if value is None else value.encode())
    producer.flush()
    print(f"produced {n} changes to 'customers-cdc'")
