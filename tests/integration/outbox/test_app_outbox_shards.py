"""An application outbox's shard count is the application's, on real PostgreSQL and Kafka: ``kstore relay
--outbox NAME`` started first waits for the application to set it up (one WARNING, not ready, nothing
made) and publishes it once it is; a mistyped name makes nothing and names the outboxes there are;
``--create --shards N`` makes it. ``kstore outbox reshard`` refuses while records wait or a relay runs,
and a drained outbox resharded 1 -> 4 publishes every record once, per key in commit order, across it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from kstore import Settings
from kstore.outbox import Outbox
from kstore.relay.loop import WAIT_FOR_OUTBOX_S
from tests.integration.outbox.test_app_outbox import metadata, orders, place_orders
from tests.integration.outbox.test_shop_web_example import load_app
from tests.integration.telemetry.test_metrics import get, port_of
from tests.support.harness import SUBPROCESS_PATH, SUPPORT_DIR, WorkerProcess, outbox_rows, read_committed, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def relays(tmp_path: Path, kafka: str) -> Iterator[Callable[..., WorkerProcess]]:
    """``kstore relay ARGS...`` subprocesses serving /readyz on a free port; killed at the end if still running."""
    started: list[WorkerProcess] = []

    def start(dsn: str, *args: str) -> WorkerProcess:
        proc = WorkerProcess(["relay", "--dsn", dsn, "--bootstrap-servers", kafka, "--metrics-port", "0",
                              "--metrics-host", "127.0.0.1", *args], {}, tmp_path / f"r{len(started) + 1}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def shard_rows(engine: sa.Engine, name: str) -> tuple[int, int]:
    """The outbox's rows in kstore_outbox_shards and kstore_outbox_relays."""
    with engine.connect() as conn:
        return tuple(int(conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE consumer_group = :g"),  # type: ignore[return-value]
                                      {"g": name}).scalar_one())
                     for table in ("kstore_outbox_shards", "kstore_outbox_relays"))


def reshard(dsn: str, name: str, shards: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", "outbox", "reshard", name, "--shards", str(shards),
                           "--dsn", dsn], cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": SUBPROCESS_PATH},
                          capture_output=True, text=True, timeout=120)


def place(engine: sa.Engine, events: Outbox, topic: str, threads: range) -> None:
    """Request threads placing orders (:func:`place_orders`: some roll back, some roll a savepoint back)."""
    running = [threading.Thread(target=place_orders, args=(engine, events, topic, t)) for t in threads]
    for t in running:
        t.start()
    for t in running:
        t.join(timeout=300)


def check_published_once_in_commit_order(engine: sa.Engine, kafka: str, topic: str) -> None:
    """Every committed order announced once, nothing rolled back, each customer's in commit order."""
    with engine.connect() as conn:
        placed = {r.id for r in conn.execute(sa.select(orders))}
    seen = [json.loads(value) for _, value in read_committed(kafka, topic)]
    assert not [e for e in seen if "ghost" in e], "a rolled-back savepoint's record was published"
    counts = Counter(e["order"] for e in seen)
    assert set(counts) == placed, "an order is missing, or a rolled-back one was announced"
    assert [o for o, c in counts.items() if c != 1] == [], "an order announced twice"
    per_customer: dict[str, list[int]] = defaultdict(list)
    for e in seen:
        per_customer[e["customer"]].append(e["n"])
    for customer, ns in per_customer.items():
        assert ns == list(range(1, len(ns) + 1)), f"{customer}'s orders out of commit order"


def test_a_relay_started_before_the_application_waits_for_its_outbox_then_publishes_it_once(
        pg_dsn: str, new_topic: Any, kafka: str, relays: Callable[..., WorkerProcess]) -> None:
    out, name = new_topic(partitions=3), f"shop-{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(pg_dsn, pool_size=10)
    metadata.create_all(engine)
    relay = relays(pg_dsn, "--outbox", name)
    port = port_of(relay)
    relay.wait_for_log(rf"WARNING .*outbox '{name}' does not exist yet: waiting for the application to set it "
                       rf"up \(Outbox\('{name}'\)\.setup\(\) or its first produce\(\)\)")
    status, body = get(port, "/readyz")
    assert status == 503 and f"outbox '{name}' does not exist yet" in body, body
    time.sleep(2 * WAIT_FOR_OUTBOX_S + 1)  # it looked again meanwhile, and said nothing more
    assert relay.log.count("does not exist yet") == 1, relay.log
    assert shard_rows(engine, name) == (0, 0), "the relay made the application's outbox"
    assert get(port, "/livez")[0] == 200

    events = Outbox(name, Settings(dsn=pg_dsn), shards=16)
    assert events.setup(engine) == 16
    relay.wait_for_log(rf"outbox '{name}' was set up with 16 shard\(s\): publishing it", timeout=30)
    place(engine, events, out, range(5))
    wait_until(lambda: outbox_rows(pg_dsn) == 0, 120, interval=0.5, what="the outbox published and emptied")
    check_published_once_in_commit_order(engine, kafka, out)
    assert shard_rows(engine, name) == (16, 16)
    wait_until(lambda: get(port, "/readyz")[0] == 200, 30, what="the relay ready")
    assert relay.terminate() == 0
    engine.dispose()


def test_the_shop_example_started_after_its_relay_ends_with_the_16_shards_it_asks_for(
        pg_dsn: str, new_topic: Any, kafka: str, relays: Callable[..., WorkerProcess],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/shop_web.py's docstring starts the service and the relay together: the relay may well
    be first."""
    out = new_topic(partitions=3)
    shop = load_app(monkeypatch, pg_dsn, out)
    relay = relays(pg_dsn, "--outbox", "shop-web")
    relay.wait_for_log(r"outbox 'shop-web' does not exist yet")
    with TestClient(shop.app) as client:
        placed = [client.post("/orders", json={"customer": f"c-{i % 3}", "amount": 100 + i}) for i in range(12)]
        assert [r.status_code for r in placed] == [201] * 12
        relay.wait_for_log(r"outbox 'shop-web' was set up with 16 shard\(s\): publishing it", timeout=30)
        wait_until(lambda: outbox_rows(pg_dsn) == 0, 90, interval=0.5, what="every order published")
    engine = sa.create_engine(pg_dsn)
    assert shard_rows(engine, "shop-web") == (16, 16)
    engine.dispose()
    seen = [json.loads(value) for _, value in read_committed(kafka, out)]
    assert sorted(e["order"] for e in seen) == sorted(r.json()["order"] for r in placed)
    assert relay.terminate() == 0


def test_a_relay_given_a_mistyped_outbox_name_makes_nothing_and_names_the_outboxes_there_are(
        pg_dsn: str, relays: Callable[..., WorkerProcess]) -> None:
    engine = sa.create_engine(pg_dsn)
    Outbox("shop", Settings(dsn=pg_dsn), shards=2).setup(engine)
    relay = relays(pg_dsn, "--outbox", "shpo")
    relay.wait_for_log(r"outbox 'shpo' does not exist yet: [^\n]*; the database has outboxes: shop\n")
    time.sleep(WAIT_FOR_OUTBOX_S + 1)
    assert shard_rows(engine, "shpo") == (0, 0), "a mistyped name made an outbox"
    assert relay.terminate() == 0
    assert relay.log.count("does not exist yet") == 1
    engine.dispose()


def test_a_relay_told_to_create_an_outbox_makes_the_shards_asked_for(
        pg_dsn: str, new_topic: Any, kafka: str, relays: Callable[..., WorkerProcess]) -> None:
    out, name = new_topic(partitions=3), f"made-{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(pg_dsn, pool_size=10)
    metadata.create_all(engine)
    relay = relays(pg_dsn, "--outbox", name, "--create", "--shards", "4")
    relay.wait_for_log(rf"outbox relay \S+ for group '{name}': 4 shard\(s\)")
    assert shard_rows(engine, name) == (4, 4) and "does not exist yet" not in relay.log
    events = Outbox(name, Settings(dsn=pg_dsn), shards=None)
    assert events.setup(engine) == 4
    place(engine, events, out, range(2))
    wait_until(lambda: outbox_rows(pg_dsn) == 0, 120, interval=0.5, what="the outbox published and emptied")
    check_published_once_in_commit_order(engine, kafka, out)
    assert relay.terminate() == 0
    engine.dispose()


def test_resharding_a_drained_outbox_from_1_to_4_shards_publishes_every_record_once_in_commit_order(
        pg_dsn: str, new_topic: Any, kafka: str, relays: Callable[..., WorkerProcess]) -> None:
    out, name = new_topic(partitions=3), f"grow-{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(pg_dsn, pool_size=10)
    metadata.create_all(engine)
    one = Outbox(name, Settings(dsn=pg_dsn), shards=1)
    assert one.setup(engine) == 1

    # Records waiting: refused.
    place(engine, one, out, range(0, 1))
    refused = reshard(pg_dsn, name, 4)
    assert refused.returncode == 2, refused
    assert re.fullmatch(rf"kstore: error: outbox '{name}' cannot be resharded now: \d+ record\(s\) wait to be "
                        r"published: drain it first .*\n", refused.stderr), refused.stderr

    # A relay publishing it (a live lease): refused, though nothing waits any more.
    r1 = relays(pg_dsn, "--outbox", name)
    place(engine, one, out, range(1, 3))
    wait_until(lambda: outbox_rows(pg_dsn) == 0, 120, interval=0.5, what="the outbox published and emptied")
    refused = reshard(pg_dsn, name, 4)
    assert refused.returncode == 2 and "relay(s) kstore-" in refused.stderr and "are running" in refused.stderr, \
        refused.stderr
    assert shard_rows(engine, name) == (1, 1)

    # Drained, its relay stopped: made anew with 4 shards, numbering on from where the one shard was.
    assert r1.terminate() == 0
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT next_seq, incarnation FROM kstore_outbox_shards "
                                      "WHERE consumer_group = :g"), {"g": name}).one()
    done = reshard(pg_dsn, name, 4)
    assert done.returncode == 0, done
    assert f"outbox '{name}': 1 shard(s) -> 4" in done.stdout
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT next_seq, incarnation FROM kstore_outbox_shards "
                                     "WHERE consumer_group = :g ORDER BY shard"), {"g": name}).all()
    assert len(after) == 4 and {(r.next_seq, r.incarnation != before.incarnation) for r in after} == \
        {(before.next_seq, True)}

    # The application with the new count; a relay (killed once it has published some) and another.
    four = Outbox(name, Settings(dsn=pg_dsn), shards=4)
    assert four.setup(engine) == 4
    r2 = relays(pg_dsn, "--outbox", name)
    writers = threading.Thread(target=place, args=(engine, four, out, range(3, 8)))
    writers.start()
    r2.wait_for_log(rf"outbox shard \d+ of group '{name}': published up to", timeout=90)
    r2.kill()
    r3 = relays(pg_dsn, "--outbox", name)
    writers.join(timeout=300)
    wait_until(lambda: outbox_rows(pg_dsn) == 0, 120, interval=0.5, what="the outbox published and emptied")
    check_published_once_in_commit_order(engine, kafka, out)
    with engine.connect() as conn:
        published = conn.execute(sa.text("SELECT shard, published_seq FROM kstore_outbox_relays "
                                         "WHERE consumer_group = :g ORDER BY shard"), {"g": name}).all()
    assert all(seq >= before.next_seq for _, seq in published), f"a shard published nothing: {published}"
    # r2 may have published every record before it was killed: r3 is then stopped once it runs (its
    # SIGTERM handler is set by then), not while it is still starting.
    r3.wait_for_log(r"serving /metrics", timeout=90)
    assert r3.terminate() == 0
    engine.dispose()
