"""kstore.outbox from application code, published by standalone relays that fail: 50 request threads
(each with sessions of its own) write 20,000 records in 2,500 transactions, a tenth of them rolled
back and a fifth of the others rolling a savepoint back. Two ``kstore relay --outbox`` processes
share the outbox's shards; one is SIGKILLed while it publishes, the other SIGSTOPped past its lease
(its shards taken, its producer fenced) and SIGCONTed while the requests still write. A
``read_committed`` reader sees every committed record once, nothing of what rolled back, and each
customer's records in the order their transactions committed. With 8 shards (a lane each) and 24
(8 lanes of 3: one lease, producer and progress record per lane)."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from kstore import Settings
from kstore.outbox import Outbox
from kstore.relay.lanes import lane_shards, lanes_of
from tests.support.harness import WorkerProcess, outbox_rows, read_committed, wait_until

pytestmark = pytest.mark.integration

OUTBOX, LEASE_S = "checkout", 3
THREADS, PER_THREAD, PER_CUSTOMER = 50, 50, 4  # two customers a transaction: 8 records
CUSTOMERS = 120
#: Transactions let through by the test at each step (2,500 in all).
STEPS = (800, 800, 450, 450)

metadata = sa.MetaData()
customers = sa.Table("customers", metadata, sa.Column("customer", sa.String(20), primary_key=True),
                     sa.Column("n", sa.Integer, nullable=False))
BUMP = sa.text("UPDATE customers SET n = n + :k WHERE customer = :c RETURNING n")
LOCK = sa.text("SELECT customer FROM customers WHERE customer = ANY(:cs) ORDER BY customer FOR UPDATE")


def rolled_back(txn: int) -> bool:
    return txn % 10 == 7


def with_savepoint(txn: int) -> bool:
    return txn % 5 == 1


def customers_of(txn: int) -> list[str]:
    """The two customers a transaction orders for."""
    a = txn * 7919 % CUSTOMERS
    b = (a + 1 + txn % (CUSTOMERS - 1)) % CUSTOMERS
    return sorted({f"c{a}", f"c{b}"})


class Requests:
    """The request threads: each runs its transactions one by one, each only once the test has let
    it through (:meth:`allow`), so the test knows what is still being written when it fails a relay."""

    def __init__(self, engine: sa.Engine, events: Outbox, topic: str) -> None:
        self.engine, self.events, self.topic = engine, events, topic
        self._gate = threading.Semaphore(0)
        self._lock = threading.Lock()
        self.done = 0
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(THREADS)]
        for thread in self.threads:
            thread.start()

    def allow(self, transactions: int) -> None:
        self._gate.release(transactions)

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a request thread did not finish"
        assert not self.errors, f"requests failed: {self.errors[:3]}"

    def _run(self, thread: int) -> None:
        for i in range(PER_THREAD):
            self._gate.acquire()
            try:
                self._transaction(thread * PER_THREAD + i)
            except RuntimeError:
                pass  # the request failed: its transaction rolled back
            except BaseException as exc:
                self.errors.append(exc)
            with self._lock:
                self.done += 1

    def _transaction(self, txn: int) -> None:
        """Each customer's counter moves on by its records: its n follow the order its transactions
        commit in (its row lock orders them). The savepoint moves a third customer's counter and
        produces a record, both rolled back with it."""
        ghost = f"c{(txn * 31 + 5) % CUSTOMERS}" if with_savepoint(txn) else None
        with Session(self.engine) as session, session.begin():
            # Every row this transaction updates, locked first in one order: no two requests deadlock.
            session.execute(LOCK, {"cs": sorted({*customers_of(txn), *([ghost] if ghost else [])})})
            for customer in customers_of(txn):
                n = session.execute(BUMP, {"c": customer, "k": PER_CUSTOMER}).scalar_one()
                for j in range(PER_CUSTOMER):
                    self.events.produce(session, self.topic, {"txn": txn, "customer": customer,
                                                              "n": n - PER_CUSTOMER + 1 + j}, key=customer)
            if ghost is not None:
                savepoint = session.begin_nested()
                n = session.execute(BUMP, {"c": ghost, "k": 1}).scalar_one()
                self.events.produce(session, self.topic, {"txn": txn, "customer": ghost, "n": n, "ghost": True},
                                    key=ghost)
                savepoint.rollback()
            if rolled_back(txn):
                raise RuntimeError("the request failed")


@pytest.fixture
def relays(tmp_path: Path, kafka: str) -> Iterator[Callable[[str], WorkerProcess]]:
    """``kstore relay --outbox`` subprocesses with a short lease; killed at the end if still running."""
    started: list[WorkerProcess] = []

    def start(dsn: str) -> WorkerProcess:
        proc = WorkerProcess(["--log-level", "DEBUG", "relay", "--dsn", dsn, "--outbox", OUTBOX,
                              "--bootstrap-servers", kafka], {"KSTORE_OUTBOX_LEASE_S": str(LEASE_S)},
                             tmp_path / f"r{len(started) + 1}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def member(relay: WorkerProcess) -> str:
    relay.wait_for_log(r"outbox relay \S+ for group", timeout=60)
    found = re.search(r"outbox relay (\S+) for group", relay.log)
    assert found is not None
    return found.group(1)


def taken_by(relay: WorkerProcess, lanes: set[int], since: int) -> bool:
    """Whether ``relay`` has logged taking each of ``lanes`` after the first ``since`` characters of its log."""
    took = re.findall(rf"outbox relay \S+ publishes (?:shard|lane) (\d+)[^']* of group '{OUTBOX}'", relay.log[since:])
    return lanes <= {int(s) for s in took}


@pytest.mark.parametrize("shards", [8, 24])
def test_two_relays_one_killed_one_paused_past_its_lease_publish_each_committed_record_once_in_commit_order(
        pg_dsn: str, new_topic: Any, kafka: str, relays: Callable[[str], WorkerProcess], shards: int) -> None:
    out = new_topic(partitions=3)
    engine = sa.create_engine(pg_dsn, pool_size=THREADS + 2, max_overflow=0)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(customers.insert(), [{"customer": f"c{c}", "n": 0} for c in range(CUSTOMERS)])
    events = Outbox(OUTBOX, Settings(dsn=pg_dsn), shards=shards)
    assert events.setup(engine) == shards

    def leases() -> dict[str, set[int]]:
        """Who holds each lane's live lease, by the database's clock."""
        held: dict[str, set[int]] = defaultdict(set)
        with engine.connect() as conn:
            for shard, owner in conn.execute(sa.text(
                    "SELECT shard, owner FROM kstore_outbox_relays WHERE consumer_group = :g AND owner IS NOT NULL "
                    "AND lease_expires >= extract(epoch from clock_timestamp())"), {"g": OUTBOX}):
                held[owner].add(shard)
        return held

    def marked(lanes: set[int]) -> int:
        """How far the shards of ``lanes`` are marked published, summed: the relays' own word, written
        after Kafka's."""
        of_lanes = sorted(s for lane in lanes for s in lane_shards(lane, shards))
        with engine.connect() as conn:
            return int(conn.execute(sa.text(
                "SELECT coalesce(sum(published_seq), 0) FROM kstore_outbox_relays WHERE consumer_group = :g "
                "AND shard = ANY(:s)"), {"g": OUTBOX, "s": of_lanes}).scalar_one())

    r1, r2 = relays(pg_dsn), relays(pg_dsn)
    m1, m2 = member(r1), member(r2)
    wait_until(lambda: {k: len(v) for k, v in leases().items()} == {m1: 4, m2: 4}, 60, interval=0.2,
               what="the two relays sharing the lanes 4 and 4")
    requests = Requests(engine, events, out)

    # r1 is SIGKILLed once it has published some of the first step, while that step is still written:
    # the step's second half is let through only then (a quiet machine wrote all of it before r1's
    # first mark).
    requests.allow(STEPS[0] // 2)
    r1_shards = leases()[m1]
    wait_until(lambda: marked(r1_shards) > 0, 60, interval=0.05, what="r1 publishing")
    requests.allow(STEPS[0] - STEPS[0] // 2)
    r1.kill()
    assert requests.done < STEPS[0], "the requests were all written before r1 was killed: it was not mid-publish"
    since = len(r2.log)
    # r2 takes r1's shards once their lease runs out; then a replacement relay gets its share.
    wait_until(lambda: taken_by(r2, r1_shards, since), 60, interval=0.2, what="r2 taking the killed relay's shards")
    r3 = relays(pg_dsn)
    m3 = member(r3)
    wait_until(lambda: {k: len(v) for k, v in leases().items()} == {m2: 4, m3: 4}, 60, interval=0.2,
               what="r2 and r3 sharing the lanes 4 and 4")

    # r2 is SIGSTOPped while it publishes the second step, which is still being written, and stays
    # stopped until r3 has taken its shards (its lease ran out), while a third step is written.
    r2_shards = leases()[m2]
    before = marked(r2_shards)
    requests.allow(STEPS[1] // 2)
    wait_until(lambda: marked(r2_shards) > before, 60, interval=0.05, what="r2 publishing")
    requests.allow(STEPS[1] - STEPS[1] // 2)
    r2.pause()
    since = len(r3.log)
    assert requests.done < STEPS[0] + STEPS[1], "the requests were all written before r2 was stopped"
    requests.allow(STEPS[2])
    wait_until(lambda: taken_by(r3, r2_shards, since), 60, interval=0.2, what="r3 taking the stopped relay's shards")
    wait_until(lambda: leases() == {m3: set(range(lanes_of(shards)))}, 60, interval=0.2,
               what="r3 alone holding every lease")

    # The zombie wakes while requests still write. Its leases' epochs moved on: its first heartbeat
    # finds each of its shards taken, and any mark it still writes matches nothing. Its producers
    # were fenced by r3's: a Kafka transaction it left open was aborted, one it still tries fails.
    # (One it had committed before it stopped is in Kafka's progress, which r3 read after fencing
    # it: r3 publishes on from there. The topic's check below holds either way.)
    since = len(r2.log)
    requests.allow(STEPS[3])
    r2.resume()
    wait_until(lambda: r2_shards <= {int(s) for s in re.findall(
        rf"outbox (?:shard|lane) (\d+)[^']* of group '{OUTBOX}' was taken by another relay"
        r"(?:: no longer publishing it| after publishing up to )",
        r2.log[since:])}, 60, interval=0.2, what="the woken relay giving up each of its shards")
    requests.join(timeout=300)

    wait_until(lambda: outbox_rows(pg_dsn) == 0, 120, interval=0.5, what="the outbox published and emptied")

    with engine.connect() as conn:
        final = {r.customer: r.n for r in conn.execute(sa.select(customers))}
    seen = [json.loads(value) for _, value in read_committed(kafka, out)]
    assert not [e for e in seen if e.get("ghost")], "a rolled-back savepoint's record was published"
    assert not [e for e in seen if rolled_back(e["txn"])], "a rolled-back transaction's record was published"
    counts = Counter((e["txn"], e["customer"], e["n"]) for e in seen)
    assert not [k for k, c in counts.items() if c > 1], "a record was published twice"
    committed = [t for t in range(THREADS * PER_THREAD) if not rolled_back(t)]
    assert len(committed) == 2250
    assert {(t, c) for t, c, _ in counts} == {(t, c) for t in committed for c in customers_of(t)}
    assert len(seen) == sum(final.values()) == 2250 * 2 * PER_CUSTOMER
    per_customer: dict[str, list[int]] = defaultdict(list)
    for e in seen:
        per_customer[e["customer"]].append(e["n"])
    for customer, n in final.items():
        assert per_customer[customer] == list(range(1, n + 1)), f"{customer}'s records out of commit order"

    assert r3.terminate() == 0
    assert r2.terminate() == 0
    engine.dispose()
