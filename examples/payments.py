"""Payments booked once, and a ``payment-booked`` event published once for each.

Each message on the ``payments`` topic is JSON like
``{"id": "p-1f2e3d-42", "account": "acct-7", "amount": 1250}`` (cents, credited to the account).
``handle()`` validates the payment, books it in ``payment_ledger``, adds it to the account's
balance in ``account_balances``, and produces a ``payment-booked`` record keyed by the account
with ``self.produce(...)``, carrying the balance after it.

Kafka to the database to Kafka, exactly once:

- the booking, the balance, the offsets and the produced record are written in the batch's one
  transaction (the record to kstore's outbox table); a relay in the worker publishes the record
  once that transaction committed, with a transactional producer. A crash, a restart or a
  rebalance neither repeats nor loses a booking, and a reader with
  ``isolation_level=read_committed`` sees each ``payment-booked`` record once;
- one account's records are in one outbox shard and one partition (the key), published in the
  order their batches committed: a reader sees each account's balances in the order they were
  reached;
- an operator's replay (``kstore offsets set --shift-by -100 --execute``) runs ``handle()`` again
  on payments already booked: the ledger row is keyed by the payment's id (``ON CONFLICT (id) DO
  NOTHING RETURNING id``), and the balance moves and the record is produced only when that INSERT
  returned a row, i.e. the first time. (``produce()`` follows the transaction, not the message:
  a replayed message that produced again would publish a second record.)

A payment that can never be booked (not JSON, a missing field, an amount that is not a positive
integer) is rejected before anything is written and dead-lettered (``kstore dead-letters list --group
payments``), producing nothing.

Run it (``python -m kstore_devbroker start`` prints the broker's address)::

    kstore migrate
    python examples/payments.py topics               # creates payments and payment-booked
    python examples/payments.py produce 1000         # 1,000 payments (a few of them bad)
    kstore worker examples/payments.py:Payments
    kstore outbox show --group payments              # what waits to be published, per shard

``PAYMENTS_BOOKED_TOPIC`` names another output topic (the tests use their own).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from sqlalchemy import text

from kstore import Message, Processor, Reject

#: Where each booking is announced; declared in ``produces``, so the worker checks it exists at its
#: start and refuses a produce() anywhere else.
BOOKED_TOPIC = os.environ.get("PAYMENTS_BOOKED_TOPIC", "payment-booked")

# The application's tables. Created by setup() (CREATE TABLE IF NOT EXISTS) so the example
# runs with one command; a real project creates them with its own migrations.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS payment_ledger ("
    " id VARCHAR(100) PRIMARY KEY, account VARCHAR(100) NOT NULL, amount BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS account_balances (account VARCHAR(100) PRIMARY KEY, balance BIGINT NOT NULL)",
)

# Works on PostgreSQL and SQLite (3.35+) alike.
BOOK = text(
    "INSERT INTO payment_ledger (id, account, amount) VALUES (:id, :account, :amount) "
    "ON CONFLICT (id) DO NOTHING RETURNING id"
)
CREDIT = text(
    "INSERT INTO account_balances (account, balance) VALUES (:account, :amount) "
    "ON CONFLICT (account) DO UPDATE SET balance = account_balances.balance + EXCLUDED.balance "
    "RETURNING balance"
)


def validate(value: Any) -> dict[str, Any]:
    """The payment as parameters, or :class:`Reject` if it can never be booked."""
    if not isinstance(value, Mapping):
        raise Reject(f"not a JSON object: {value!r}")
    missing = [f for f in ("id", "account", "amount") if value.get(f) in (None, "")]
    if missing:
        raise Reject(f"missing {', '.join(missing)}")
    amount = value["amount"]
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise Reject(f"amount must be a positive integer number of cents, got {amount!r}")
    return {"id": str(value["id"]), "account": str(value["account"]), "amount": amount}


class Payments(Processor):
    topics = ["payments"]
    produces = [BOOKED_TOPIC]
    group = "payments"
    value_format = "json"
    on_error = "dead_letter"  # as are values that are not JSON: kstore never retries those

    def setup(self) -> None:
        self.booked_topic = BOOKED_TOPIC
        with self.engine.begin() as conn:
            for ddl in SCHEMA:
                conn.execute(text(ddl))

    def handle(self, msg: Message) -> None:
        payment = validate(msg.value)  # raises Reject: nothing written, nothing produced
        if self.session.execute(BOOK, payment).first() is None:
            return  # booked before: this is a replay; its record was produced then
        balance = self.session.execute(CREDIT, payment).scalar_one()
        # Written to the outbox in this batch's transaction; published once it commits.
        self.produce(self.booked_topic, {**payment, "balance": balance}, key=payment["account"],
                     headers={"payment-id": payment["id"]})


def sample_payments(n: int, run: str, accounts: int = 20, bad_every: int = 100) -> list[dict[str, Any]]:
    """``n`` payments to ``accounts`` accounts, with ids unique to ``run``; every ``bad_every``-th one is invalid."""
    import random

    rng = random.Random(run)
    out: list[dict[str, Any]] = []
    for i in range(n):
        payment: dict[str, Any] = {"id": f"p-{run}-{i}", "account": f"acct-{rng.randrange(accounts)}",
                                   "amount": rng.randint(1, 10_000)}
        if i % bad_every == bad_every - 1:
            payment["amount"] = 0
        out.append(payment)
    return out


if __name__ == "__main__":
    import secrets
    import sys

    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    servers = os.environ.get("KSTORE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    if sys.argv[1:2] == ["topics"]:
        names = ["payments", os.environ.get("PAYMENTS_BOOKED_TOPIC", "payment-booked")]
        admin = AdminClient({"bootstrap.servers": servers, "log_level": 4})  # librdkafka's warnings, not its notices
        topics = [NewTopic(name, num_partitions=3, replication_factor=1) for name in names]
        for future in admin.create_topics(topics).values():
            future.result()  # raises if the topic could not be created (it exists already, say)
        print(f"created topics {names[0]!r} and {names[1]!r} (3 partitions each)")
    elif sys.argv[1:2] == ["produce"]:
        producer = Producer({"bootstrap.servers": servers})
        # New ids each run: the same payment sent again is booked (and announced) once.
        payments = sample_payments(int(sys.argv[2]) if len(sys.argv) > 2 else 1000, secrets.token_hex(3))
        for p in payments:  # keyed by the account: its payments stay in order
            if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
                producer.flush()
            producer.produce("payments", key=p["account"].encode(), value=json.dumps(p).encode())
        producer.flush()
        print(f"produced {len(payments)} payments to 'payments' ({len(payments) // 100} of them invalid)")
    else:
        sys.exit("usage: python examples/payments.py topics | produce [N]")
