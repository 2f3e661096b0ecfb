"""The examples in examples/, run as users run them (``kstore worker examples/X.py:Class``) against
real Kafka and PostgreSQL: their results equal what the produced messages imply, across a SIGKILL
and restart and across an operator's replay (``kstore offsets set --shift-by -N --execute``); what
one of them produces to Kafka is what a read_committed reader sees, once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from tests.support.harness import REPO_DIR, SUPPORT_DIR, read_committed, stored_offsets, wait_until

EXAMPLES = REPO_DIR / "examples"
Sent = tuple[str, int, int]


def rows(dsn: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql), params)]
    finally:
        engine.dispose()


def send(producer: Any, topic: str, records: Sequence[tuple[str | None, bytes | None]]) -> list[Sent]:
    """Produce ``(key, value)`` records in order and wait for them: [(topic, partition, offset)]."""
    futures = [producer.send(topic, key=None if k is None else k.encode(), value=v) for k, v in records]
    producer.flush()
    return [(m.topic, m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)]


def log_ends(sent: Sequence[Sent]) -> dict[tuple[str, int], int]:
    ends: dict[tuple[str, int], int] = {}
    for t, p, o in sent:
        ends[(t, p)] = max(ends.get((t, p), 0), o + 1)
    return ends


def caught_up(dsn: str, group: str, sent: Sequence[Sent]) -> bool:
    return stored_offsets(dsn, group) == log_ends(sent)


def replay(dsn: str, kafka: str, group: str, topic: str, shift: int) -> str:
    """``kstore offsets set --shift-by SHIFT --execute`` on every partition, as an operator runs it."""
    r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "set", "--group", group, "--topic", topic,
                        "--shift-by", str(shift), "--reason", "test replay", "--execute", "--dsn", dsn,
                        "--bootstrap-servers", kafka], capture_output=True, text=True, timeout=120,
                       cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def kill_mid_run_and_restart(workers: Any, dsn: str, topic: str, group: str, processor: str, *, batch: int,
                             table: str, kill_at: int, total: int, sent: Sequence[Sent],
                             env: dict[str, str] | None = None) -> tuple[Any, Any, int]:
    """SIGKILL a worker once ``kill_at`` rows are in ``table`` (before all ``total``), start another
    and wait until it has caught up; returns both workers and the rows there at the kill."""
    count = f"SELECT count(*) FROM {table}"
    w1 = workers(dsn, topic, group, processor=processor, env=env, args=["--max-batch-size", str(batch)])
    wait_until(lambda: rows(dsn, f"SELECT to_regclass('{table}') IS NOT NULL")[0][0]
               and rows(dsn, count)[0][0] >= kill_at, 60, interval=0.02, what=f"{kill_at:,} rows in {table}")
    w1.kill()
    at_kill: int = rows(dsn, count)[0][0]
    assert at_kill < total, "the worker finished before the kill"
    w2 = workers(dsn, topic, group, processor=processor, env=env, args=["--max-batch-size", str(batch)])
    wait_until(lambda: caught_up(dsn, group, sent), 60, interval=0.05, what="the restarted worker to catch up")
    return w1, w2, at_kill


def dead_letters(dsn: str, group: str) -> list[tuple[str, int, int, str]]:
    return [(t, p, o, e) for t, p, o, e in rows(
        dsn, 'SELECT topic, partition_id, "offset", error FROM kstore_dead_letters WHERE consumer_group = :g',
        g=group)]


# -- 1. the money ledger ----------------------------------------------------------------------------------

def ledger_input(n: int, n_bad: int, accounts: int = 50) -> tuple[list[tuple[str | None, bytes]], set[int]]:
    """``n`` transfers as (key, JSON) records; ``n_bad`` of them invalid, at the indexes returned.

    A few bad ones are among the last messages, so the replay meets them again."""
    rng = random.Random(2024)
    names = [f"acct-{k}" for k in range(accounts)]
    bad_at = set(rng.sample(range(n - 200), n_bad - 4)) | {n - 40, n - 30, n - 20, n - 10}
    kinds: list[Callable[[dict[str, Any]], Any]] = [
        lambda t: {**t, "amount": 0},
        lambda t: {**t, "amount": -t["amount"]},
        lambda t: {**t, "to": t["from"]},
        lambda t: {k: v for k, v in t.items() if k != "to"},
        lambda t: {k: v for k, v in t.items() if k != "id"},
        lambda t: {**t, "amount": "12.50"},
        lambda t: [t],
        lambda t: b"{not json",
    ]
    records: list[tuple[str | None, bytes]] = []
    for i in range(n):
        a, b = rng.sample(names, 2)
        transfer: Any = {"id": f"tr-{i}", "from": a, "to": b, "amount": rng.randint(1, 100_000)}
        if i in bad_at:
            transfer = kinds[len([j for j in bad_at if j < i]) % len(kinds)](transfer)
        value = transfer if isinstance(transfer, bytes) else json.dumps(transfer).encode()
        records.append((a, value))
    return records, bad_at


def test_ledger_sums_to_zero_and_applies_each_transfer_once_across_sigkill_and_replay(
        pg_dsn: str, kafka: str, new_topic: Any, producer: Any, workers: Any) -> None:
    n, n_bad = 20_000, 20
    topic, group = new_topic(4), "ledger"
    records, bad_at = ledger_input(n, n_bad)
    started = time.monotonic()
    sent = send(producer, topic, records)
    good = [json.loads(v) for i, (_, v) in enumerate(records) if i not in bad_at]
    expected: Counter[str] = Counter()
    for t in good:
        expected[t["from"]] -= t["amount"]
        expected[t["to"]] += t["amount"]
    processor = f"{EXAMPLES / 'ledger.py'}:Ledger"

    # Batches of 1,000 so the kill lands mid-run, with commits before it and a batch in flight.
    w1, w2, at_kill = kill_mid_run_and_restart(workers, pg_dsn, topic, group, processor, batch=1000,
                                               table="transfers", kill_at=4000, total=len(good), sent=sent)
    drained = time.monotonic() - started

    plan = replay(pg_dsn, kafka, group, topic, -100)
    w2.wait_for_log(r"reset to \d+ by an operator", count=4, timeout=30)
    wait_until(lambda: caught_up(pg_dsn, group, sent), 60, interval=0.05, what="the replay to catch up")
    assert w2.terminate() == 0

    balances = dict(rows(pg_dsn, "SELECT account, balance FROM balances"))
    assert sum(balances.values()) == 0, "money was created or destroyed"
    assert balances == {a: b for a, b in expected.items()}, "a transfer was applied twice or never"
    applied = {r[0] for r in rows(pg_dsn, "SELECT id FROM transfers")}
    assert applied == {t["id"] for t in good}
    letters = dead_letters(pg_dsn, group)
    assert {(t, p, o) for t, p, o, _ in letters} == {sent[i] for i in bad_at}
    assert all(e.startswith(("Reject: ", "DeserializationError: JSONDecodeError: ")) for *_, e in letters), letters
    # Those in the replayed tail were rejected again: their waiting letters took the second attempt
    # (one letter per message, never a second one that a replay of every letter would apply twice).
    ends = log_ends(sent)
    in_tail = {sent[i] for i in bad_at if sent[i][2] >= ends[sent[i][:2]] - 100}
    assert len(letters) == n_bad
    attempts = {(t, p, o): n for t, p, o, n in rows(
        pg_dsn, 'SELECT topic, partition_id, "offset", attempts FROM kstore_dead_letters WHERE consumer_group = :g',
        g=group)}
    assert attempts == {sent[i]: 2 if sent[i] in in_tail else 1 for i in bad_at}
    # Never retried with backoff: Reject is final, and so is a value that is not JSON (dead-lettered at
    # once in its batch, never narrowed down).
    assert "failed (attempt" not in w1.log + w2.log  # the retry's line, as test_failures counts it
    print(f"ledger: {n:,} transfers ({n_bad} bad), SIGKILL after {at_kill:,} applied, drained in {drained:.1f}s; "
          f"replayed 4x100 ({in_tail} bad among them); {len(balances)} balances sum to 0\n{plan}")


# -- 2. ORM models --------------------------------------------------------------------------------------

def order_events(n_orders: int) -> list[dict[str, Any]]:
    """Each order created, then paid, then (3 in 4) shipped; orders interleaved, each in order."""
    rng = random.Random(5)
    pending = {i: ["created", "paid", *(["shipped"] if i % 4 else [])] for i in range(n_orders)}
    events: list[dict[str, Any]] = []
    while pending:
        order = rng.choice(list(pending))
        kind = pending[order].pop(0)
        if not pending[order]:
            del pending[order]
        event: dict[str, Any] = {"event_id": f"e-{len(events)}", "order_id": order, "type": kind}
        if kind == "created":
            event |= {"customer": f"cust-{order % 17}", "total_cents": 100 * order + 1}
        events.append(event)
    return events


def test_orm_projection_matches_the_events_across_sigkill_and_replay(
        pg_dsn: str, kafka: str, new_topic: Any, producer: Any, workers: Any) -> None:
    n_orders = 800
    topic, group = new_topic(4), "orders"
    events = order_events(n_orders)
    bad: list[dict[str, Any]] = [
        {"event_id": "e-bad-1", "order_id": 10**6, "type": "paid"},  # never created: rejected after a read
        {"event_id": "e-bad-2", "type": "refunded"},  # unknown: rejected before any read
    ]
    records = [(str(e["order_id"]), json.dumps(e).encode()) for e in events[:1000]]
    records += [(str(e.get("order_id")), json.dumps(e).encode()) for e in bad]
    records += [(str(e["order_id"]), json.dumps(e).encode()) for e in events[1000:]]
    sent = send(producer, topic, records)
    processor = f"{EXAMPLES / 'orm_models.py'}:OrderProjection"

    _, w2, at_kill = kill_mid_run_and_restart(workers, pg_dsn, topic, group, processor, batch=200,
                                              table="order_events", kill_at=600, total=len(events), sent=sent)
    replay(pg_dsn, kafka, group, topic, -100)
    w2.wait_for_log(r"reset to \d+ by an operator", count=4, timeout=30)
    wait_until(lambda: caught_up(pg_dsn, group, sent), 60, interval=0.05, what="the replay to catch up")
    assert w2.terminate() == 0

    expected: dict[int, tuple[str, int, int, bool, bool]] = {}
    for e in events:
        _, total, count, *_ = expected.get(e["order_id"], ("", 0, 0))
        expected[e["order_id"]] = (e["type"], e.get("total_cents", total), count + 1,
                                   e["type"] != "created", e["type"] == "shipped")
    got = {r[0]: tuple(r[1:]) for r in rows(
        pg_dsn, "SELECT id, status, total_cents, events, paid_at IS NOT NULL, shipped_at IS NOT NULL FROM orders")}
    assert got == expected
    applied = Counter(r[0] for r in rows(pg_dsn, "SELECT event_id FROM order_events"))
    assert applied == Counter(e["event_id"] for e in events)
    letters = dead_letters(pg_dsn, group)
    assert sorted(e.split(":")[0] for *_, e in letters) == ["Reject", "Reject"]
    assert {(t, p, o) for t, p, o, _ in letters} == set(sent[1000:1002])
    print(f"orm: {len(events):,} events for {n_orders} orders, SIGKILL after {at_kill}, replayed 4x100; "
          f"{sum(1 for s in got.values() if s[0] == 'shipped')} shipped, 2 dead letters")


# -- 3. change-data mirror ------------------------------------------------------------------------------

def cdc_changes(n: int, keys: int) -> list[tuple[str, bytes | None]]:
    """Inserts, updates and tombstones of ``keys`` keys; a deleted key may come back."""
    rng = random.Random(11)
    changes: list[tuple[str, bytes | None]] = []
    for i in range(n):
        key = f"c-{rng.randrange(keys)}"
        if rng.random() < 0.15:
            changes.append((key, None))
        else:
            row = {"name": f"Customer {key} v{i}", "email": f"{key}.{i}@example.com",
                   "plan": rng.choice(["free", "pro", "team"])}
            changes.append((key, json.dumps(row).encode()))
    return changes


def test_cdc_mirror_equals_the_final_state_per_key_and_after_a_replay(
        pg_dsn: str, kafka: str, new_topic: Any, producer: Any, workers: Any) -> None:
    n, keys = 5000, 300
    topic, group = new_topic(4), "mirror"
    changes = cdc_changes(n, keys)
    sent = send(producer, topic, changes)
    final: dict[str, tuple[str, str, str, int, int]] = {}
    for (key, value), (_, p, o) in zip(changes, sent, strict=True):
        if value is None:
            final.pop(key, None)
        else:
            row = json.loads(value)
            final[key] = (row["name"], row["email"], row["plan"], p, o)

    def mirror() -> dict[str, tuple[Any, ...]]:
        return {r[0]: tuple(r[1:]) for r in rows(
            pg_dsn, "SELECT id, name, email, plan, source_partition, source_offset FROM customers_mirror")}

    w = workers(pg_dsn, topic, group, processor=f"{EXAMPLES / 'cdc_mirror.py'}:CustomerMirror")
    wait_until(lambda: caught_up(pg_dsn, group, sent), 60, interval=0.05, what="the mirror to catch up")
    first = mirror()
    assert first == final
    assert 0 < len(final) < keys, "some keys must end deleted"

    replay(pg_dsn, kafka, group, topic, -400)
    w.wait_for_log(r"reset to \d+ by an operator", count=4, timeout=30)
    wait_until(lambda: caught_up(pg_dsn, group, sent), 60, interval=0.05, what="the replay to catch up")
    assert w.terminate() == 0
    assert mirror() == final
    assert not dead_letters(pg_dsn, group)
    tombstones = sum(1 for _, v in changes if v is None)
    print(f"cdc: {n:,} changes of {keys} keys ({tombstones} tombstones) -> {len(final)} rows; "
          f"equal again after replaying the last 4x400")


# -- 4. payments booked, and announced on Kafka ---------------------------------------------------------

def payment_input(n: int, n_bad: int, accounts: int = 30) -> tuple[list[tuple[str | None, bytes]], set[int]]:
    """``n`` payments as (account, JSON) records; ``n_bad`` of them invalid (one not even JSON), at the
    indexes returned (two among the last messages, so the replay meets them again)."""
    rng = random.Random(77)
    bad_at = set(rng.sample(range(n - 200), n_bad - 2)) | {n - 30, n - 10}
    records: list[tuple[str | None, bytes]] = []
    for i in range(n):
        payment: dict[str, Any] = {"id": f"pay-{i}", "account": f"acct-{rng.randrange(accounts)}",
                                   "amount": rng.randint(1, 100_000)}
        if i in bad_at:
            payment["amount"] = [0, -5, "12.50", None][i % 4]
        value = json.dumps(payment).encode()
        records.append((payment["account"], value[:-1] if i == min(bad_at) else value))  # one not JSON
    return records, bad_at


def test_payments_are_booked_once_and_announced_once_in_order_across_sigkill_and_replay(
        pg_dsn: str, kafka: str, new_topic: Any, producer: Any, workers: Any) -> None:
    n, n_bad = 5000, 12
    topic, out, group = new_topic(4), new_topic(3), "payments"
    records, bad_at = payment_input(n, n_bad)
    sent = send(producer, topic, records)
    good = [json.loads(v) for i, (_, v) in enumerate(records) if i not in bad_at]
    processor = f"{EXAMPLES / 'payments.py'}:Payments"

    # The kill takes the worker's relay with it, mid-publish; the restarted worker's relay takes over.
    _, w2, at_kill = kill_mid_run_and_restart(workers, pg_dsn, topic, group, processor, batch=250,
                                              table="payment_ledger", kill_at=1500, total=len(good), sent=sent,
                                              env={"PAYMENTS_BOOKED_TOPIC": out})
    replay(pg_dsn, kafka, group, topic, -100)
    w2.wait_for_log(r"reset to \d+ by an operator", count=4, timeout=30)
    wait_until(lambda: caught_up(pg_dsn, group, sent) and rows(pg_dsn, "SELECT count(*) FROM kstore_outbox")[0][0] == 0,
               90, interval=0.1, what="the replay to catch up and the outbox to empty")
    assert w2.terminate() == 0

    # Booked once: the ledger holds every good payment, and the balances are their sums.
    booked = rows(pg_dsn, "SELECT id, account, amount FROM payment_ledger")
    assert sorted(booked) == sorted((p["id"], p["account"], p["amount"]) for p in good)
    expected: Counter[str] = Counter()
    for p in good:
        expected[p["account"]] += p["amount"]
    assert dict(rows(pg_dsn, "SELECT account, balance FROM account_balances")) == dict(expected)

    # Announced once, per account in the order booked: each record's balance is the running sum.
    seen = [(key, json.loads(value)) for key, value in read_committed(kafka, out)]
    assert Counter(v["id"] for _, v in seen) == Counter(p["id"] for p in good), "a payment announced twice or never"
    assert all(key == v["account"].encode() for key, v in seen)
    per_account: dict[str, list[tuple[str, int]]] = {}
    for _, v in seen:
        per_account.setdefault(v["account"], []).append((v["id"], v["balance"]))
    running: Counter[str] = Counter()
    position: Counter[str] = Counter()
    for p in good:  # one account's payments are in one input partition: booked in the order sent
        account = p["account"]
        running[account] += p["amount"]
        got = per_account[account][position[account]]
        assert got == (p["id"], running[account]), f"{account}: out of order at {p['id']}: {got}"
        position[account] += 1

    letters = dead_letters(pg_dsn, group)
    assert {(t, p, o) for t, p, o, _ in letters} == {sent[i] for i in bad_at}
    errors = sorted(e.partition(":")[0] for *_, e in letters)
    assert errors == ["DeserializationError"] + ["Reject"] * (n_bad - 1), letters
    print(f"payments: {n:,} ({n_bad} bad), SIGKILL after {at_kill:,} booked, replayed 4x100; "
          f"{len(seen):,} payment-booked records read once each, {len(expected)} accounts in order")
