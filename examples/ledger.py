"""A money ledger: transfers between accounts, each applied exactly once.

Each message on the ``transfers`` topic is JSON like
``{"id": "t-42", "from": "alice", "to": "bob", "amount": 250}`` (amounts in cents).
``handle()`` validates the transfer, records it in ``transfers`` and moves the money
in ``balances``. A transfer only moves money, so the sum of all balances stays 0.

Two guards make it exactly once:

- kstore commits the offsets in the same transaction as these writes, so a crash, a
  restart or a rebalance neither repeats nor loses a transfer;
- an operator's replay (``kstore offsets set --shift-by -100 --execute``) does run
  ``handle()`` again on transfers already applied: the transfer row is keyed by its id
  (``ON CONFLICT (id) DO NOTHING RETURNING id``), and the balances move only when that
  INSERT returned a row, i.e. the first time.

A transfer that can never succeed (missing field, amount <= 0, from == to, a value that
is not JSON) is rejected before anything is written and lands in ``kstore_dead_letters``
(``kstore dead-letters list --group ledger``), in the same transaction as the rest of its
batch, with no retries.

Run it (``python -m kstore_devbroker start`` prints the broker's address)::

    kstore migrate
    python examples/ledger.py produce 1000           # 1,000 transfers (a few of them bad)
    kstore worker examples/ledger.py:Ledger
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import text

from kstore import Message, Processor, Reject

# The application's tables. Created by setup() (CREATE TABLE IF NOT EXISTS) so the example
# runs with one command; a real project creates them with its own migrations.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS transfers ("
    " id VARCHAR(100) PRIMARY KEY, from_account VARCHAR(100) NOT NULL,"
    " to_account VARCHAR(100) NOT NULL, amount BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS balances (account VARCHAR(100) PRIMARY KEY, balance BIGINT NOT NULL)",
)

# Works on PostgreSQL and SQLite (3.35+) alike.
INSERT_TRANSFER = text(
    "INSERT INTO transfers (id, from_account, to_account, amount) VALUES (:id, :from, :to, :amount) "
    "ON CONFLICT (id) DO NOTHING RETURNING id"
)
# Both accounts in one statement; from != to, so it never touches a row twice.
MOVE_MONEY = text(
    "INSERT INTO balances (account, balance) VALUES (:from, -:amount), (:to, :amount) "
    "ON CONFLICT (account) DO UPDATE SET balance = balances.balance + EXCLUDED.balance"
)


def validate(value: Any) -> dict[str, Any]:
    """The transfer as parameters, or :class:`Reject` if it can never be applied."""
    if not isinstance(value, Mapping):
        raise Reject(f"not a JSON object: {value!r}")
    missing = [f for f in ("id", "from", "to", "amount") if value.get(f) in (None, "")]
    if missing:
        raise Reject(f"missing {', '.join(missing)}")
    amount = value["amount"]
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise Reject(f"amount must be an integer number of cents, got {amount!r}")
    if amount <= 0:
        raise Reject(f"amount must be positive, got {amount}")
    if value["from"] == value["to"]:
        raise Reject(f"transfer to the same account {value['from']!r}")
    return {"id": str(value["id"]), "from": str(value["from"]), "to": str(value["to"]), "amount": amount}


class Ledger(Processor):
    topics = ["transfers"]
    group = "ledger"
    value_format = "json"
    # A value that is not JSON fails in deserialize(), before handle(): kstore dead-letters it at
    # once, in its batch's transaction, as it does a Reject (raised below), with no retries.
    on_error = "dead_letter"

    def setup(self) -> None:
        with self.engine.begin() as conn:
            for ddl in SCHEMA:
                conn.execute(text(ddl))

    def handle(self, msg: Message) -> None:
        # Validate BEFORE writing: a Reject raised before the session was used is dead-lettered
        # inside this batch's transaction, and the rest of the batch commits with it.
        transfer = validate(msg.value)
        inserted = self.session.execute(INSERT_TRANSFER, transfer).first()
        if inserted is None:
            return  # applied before: this is a replay, the money already moved
        self.session.execute(MOVE_MONEY, transfer)


def sample_transfers(n: int, accounts: int = 20, bad_every: int = 100) -> list[dict[str, Any]]:
    """``n`` transfers between ``accounts`` accounts; every ``bad_every``-th one is invalid."""
    import random

    rng = random.Random(42)
    out: list[dict[str, Any]] = []
    for i in range(n):
        a, b = rng.sample([f"acct-{k}" for k in range(accounts)], 2)
        transfer: dict[str, Any] = {"id": f"t-{i}", "from": a, "to": b, "amount": rng.randint(1, 10_000)}
        if i % bad_every == bad_every - 1:
            transfer["amount"] = -transfer["amount"]
        out.append(transfer)
    return out


if __name__ == "__main__":
    import os
    import sys

    from confluent_kafka import Producer

    if sys.argv[1:2] != ["produce"]:
        sys.exit("usage: python examples/ledger.py produce [N]")
    producer = Producer({"bootstrap.servers": os.environ.get("KSTORE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")})
    transfers = sample_transfers(int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
    for t in transfers:  # keyed by the paying account: its transfers stay in order
        if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
            producer.flush()
        producer.produce("transfers", key=t["from"].encode(), value=json.dumps(t).encode())
    producer.flush()
    print(f"produced {len(transfers)} transfers to 'transfers' ({len(transfers) // 100} of them invalid)")
