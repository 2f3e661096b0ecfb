"""The outbox and its relay, driven step by step in this process against real Kafka and PostgreSQL:
numbering in commit order, progress kept in Kafka's transaction (and only this database's; marks
left by relays of earlier versions read once),
a relay stopped between Kafka's commit and the database's mark, leases and their fencing."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from kstore import Settings
from kstore.db.store import make_engine
from kstore.kafka.clients import publisher_class
from kstore.kafka.seam import Committed, Fenced
from kstore.ops.outbox import show_outbox
from kstore.relay import loop as relay_module
from kstore.relay import publishing
from kstore.relay.lane import BLOCKED_RETRY_FIRST_S, BLOCKED_RETRY_S, RelayStuck
from kstore.relay.lanes import MAX_LANES, lane_shards, shard_of, share
from kstore.relay.loop import Relay
from kstore.relay.progress import highest_mark, progress_mark, progress_topic, shard_id
from kstore.relay.store import Outbox
from kstore.types import Produced
from tests.support.harness import read_committed, read_committed_records, wait_until

GROUP = "relayed"
#: The relay's Kafka client in the test running (relay_for's default): every test that publishes
#: runs with each publisher.
CLIENTS = ("confluent", "kafka-python")
_client = ["kafka-python"]


def pytest_generate_tests(metafunc: Any) -> None:
    if "kafka" in metafunc.fixturenames and "first_client" not in metafunc.fixturenames:
        metafunc.parametrize("relay_client", CLIENTS, indirect=True)


@pytest.fixture(autouse=True)
def relay_client(request: Any) -> Iterator[str]:
    _client[0] = getattr(request, "param", "kafka-python")
    yield _client[0]
    _client[0] = "kafka-python"


@pytest.fixture
def engine(pg_dsn: str) -> Iterator[Any]:
    e = make_engine(Settings(dsn=pg_dsn))
    yield e
    e.dispose()


def write_batch(engine: Any, outbox: Outbox, records: list[Produced]) -> None:
    with engine.connect() as conn, conn.begin():
        outbox.write(conn, records)


def relay_for(engine: Any, kafka: str, dsn: str, group: str = GROUP, **settings: Any) -> Relay:
    settings = {"outbox_shards": 2, "outbox_lease_s": 3, "relay_client": _client[0], **settings}
    s = Settings(dsn=dsn, bootstrap_servers=kafka, **settings)
    relay = Relay(s, group, engine)
    relay.outbox.ensure_shards(s.outbox_shards)
    return relay


def drain(relay: Relay) -> None:
    """Turn the relay until every shard it can hold has nothing waiting."""
    wait_until(lambda: not relay.turn() and not any(s.waiting for s in relay.outbox.state())
               and relay.shards_held, 60, interval=0.05, what="the relay to publish everything")


def values(kafka: str, topic: str) -> list[bytes]:
    return [v for _, v in read_committed(kafka, topic)]


def test_records_are_published_once_in_commit_order_and_the_outbox_empties(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any) -> None:
    out = new_topic(partitions=1)
    relay = relay_for(engine, kafka, pg_dsn)
    outbox = relay.outbox
    for batch in range(3):
        write_batch(engine, outbox, [Produced(out, f"{batch}-{i}".encode(), b"k") for i in range(5)])
    drain(relay)
    assert values(kafka, out) == [f"{b}-{i}".encode() for b in range(3) for i in range(5)]
    state = {s.shard: s for s in outbox.state()}
    assert sum(s.waiting for s in state.values()) == 0
    assert sum(s.published_seq for s in state.values()) == 15
    relay.close()


def test_a_group_that_produces_nothing_makes_no_producer_and_no_progress_topic(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any, admin: Any, relay_client: str) -> None:
    """Every worker runs a relay; one whose group never produced holds its lanes without a Kafka
    producer or a progress topic, and makes them at the first record."""
    out, group = new_topic(partitions=1), f"quiet-{relay_client}"
    relay = relay_for(engine, kafka, pg_dsn, group=group)
    wait_until(lambda: (relay.turn(), relay.shards_held)[1] == [0, 1], 30, interval=0.1, what="both shards held")
    for _ in range(5):
        assert not relay.turn()
    assert all(state.publisher is None for state in relay._held.values())
    assert progress_topic(group) not in admin.list_topics()
    write_batch(engine, relay.outbox, [Produced(out, b"first", b"k")])
    drain(relay)
    assert values(kafka, out) == [b"first"]
    assert progress_topic(group) in admin.list_topics()
    relay.close()


def test_seq_follows_commit_order_not_statement_order(engine: Any, pg_dsn: str, kafka: str) -> None:
    """T1 writes first but commits second: T2 waits for the shard's lock, then numbers after T1."""
    outbox = Outbox(engine, GROUP)
    outbox.ensure_shards(1)
    t1 = engine.connect()
    trans = t1.begin()
    outbox.write(t1, [Produced("out", b"first-written", b"k")])
    done = threading.Event()

    def second() -> None:
        write_batch(engine, outbox, [Produced("out", b"second-written", b"k")])
        done.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not done.wait(1.0), "the second batch must wait for the first's shard lock"
    trans.commit()
    t1.close()
    thread.join(30)
    assert [(p.seq, p.record.value) for p in outbox.pending({0: 0}, 10)] == [(1, b"first-written"),
                                                                             (2, b"second-written")]
    t1 = engine.connect()
    trans = t1.begin()
    outbox.write(t1, [Produced("out", b"rolled-back", b"k")])
    trans.rollback()
    t1.close()
    write_batch(engine, outbox, [Produced("out", b"after-rollback", b"k")])
    assert [p.seq for p in outbox.pending({0: 0}, 10)] == [1, 2, 3], "no gap where a batch rolled back"


def test_a_relay_stopped_between_kafka_commit_and_its_mark_publishes_nothing_twice(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any, monkeypatch: Any) -> None:
    stopped_between_commit_and_mark(engine, pg_dsn, kafka, new_topic, monkeypatch, _client[0], _client[0])


@pytest.mark.parametrize("first_client, second_client", [("kafka-python", "confluent"), ("confluent", "kafka-python")])
def test_a_shard_taken_over_by_a_relay_on_the_other_client_publishes_nothing_twice(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any, monkeypatch: Any, first_client: str,
        second_client: str) -> None:
    """Both publishers write and read the same progress marks (confluent-kafka's end in a NUL)."""
    stopped_between_commit_and_mark(engine, pg_dsn, kafka, new_topic, monkeypatch, first_client, second_client)


def stopped_between_commit_and_mark(engine: Any, pg_dsn: str, kafka: str, new_topic: Any, monkeypatch: Any,
                                    first_client: str, second_client: str) -> None:
    out = new_topic(partitions=2)
    first = relay_for(engine, kafka, pg_dsn, relay_client=first_client)
    write_batch(engine, first.outbox, [Produced(out, f"a{i}".encode(), f"k{i}".encode()) for i in range(20)])
    # Kafka commits, then the database's mark never lands (as if the relay died right there).
    monkeypatch.setattr(Outbox, "mark_published", lambda *a, **k: True)
    # Turned until Kafka has every record (a fresh broker's coordinator may first answer "not yet",
    # and the shard backs off before it tries again).
    wait_until(lambda: [first.turn(), len(values(kafka, out)) == 20][1], 60, interval=0.2,
               what="the first relay to publish every record")
    monkeypatch.undo()
    assert sum(s.waiting for s in first.outbox.state()) == 20, "nothing marked in the database"
    # It is gone without a word: its lease runs out and a new relay takes the shards over.
    first._held.clear()
    second = relay_for(engine, kafka, pg_dsn, relay_client=second_client)
    write_batch(engine, second.outbox, [Produced(out, f"b{i}".encode(), f"k{i}".encode()) for i in range(20)])
    drain(second)
    got = sorted(values(kafka, out))
    assert got == sorted([f"a{i}".encode() for i in range(20)] + [f"b{i}".encode() for i in range(20)])
    second.close()


def refusal_waits(caplog: Any) -> list[float]:
    """The waits the relay's ERROR lines for a refused row named, in order."""
    return [r.args[-1] for r in caplog.records if r.name == publishing.__name__ and "Kafka refused it" in r.msg]


def test_a_row_kafka_refuses_stops_its_shard_and_nothing_after_it_is_skipped(
        engine: Any, pg_dsn: str, kafka: str, admin: Any, relay_client: str, caplog: Any) -> None:
    """A record the topic refuses (larger than its max.message.bytes) aborts its transaction and
    blocks the shard on that row, retried after a wait that doubles each time, never skipped; once
    the topic takes it, everything goes out in order."""
    caplog.set_level(logging.ERROR, logger=publishing.__name__)
    out = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(out, num_partitions=1, replication_factor=1,
                                  topic_configs={"max.message.bytes": "2000"})])
    if relay_client == "kafka-python":
        pytest.xfail("kafka-python splits the refused request and retries it past the publish timeout: the "
                     "rows wait and are retried, nothing is skipped, but the row to blame is not named")
    relay = relay_for(engine, kafka, pg_dsn, group="refused", outbox_shards=1)
    write_batch(engine, relay.outbox, [Produced(out, b"before", b"k"), Produced(out, b"x" * 5000, b"k")])
    write_batch(engine, relay.outbox, [Produced(out, b"after", b"k")])
    wait_until(lambda: [relay.turn(), relay.shards_blocked == [0]][1], 60, interval=0.05,
               what="the relay to stop on the refused row")
    state = relay._held[0]
    assert state.blocked_on == (0, 2), "blocked on the refused row itself"
    assert values(kafka, out) == [b"before"], "the rows before the refused one go out, none after it"
    assert state.published == {0: 1}
    assert not relay.turn(), "a blocked shard waits for its retry"
    state.not_before = 0.0  # its retry is due; the row is still refused
    wait_until(lambda: [relay.turn(), len(refusal_waits(caplog)) >= 2][1], 60, interval=0.05,
               what="the relay to stop on the refused row again")
    assert state.blocked_on == (0, 2) and values(kafka, out) == [b"before"]
    # The operator's tools name the row and Kafka's answer, and that the shard waits on it.
    (shown,) = show_outbox(relay.settings, "refused")
    assert shown.refused is not None and shown.refused.seq == 2 and "too large" in shown.refused.reason.lower()
    assert shown.refusal is not None and shown.refusal.endswith("(the shard waits on it)")
    waits = refusal_waits(caplog)
    assert waits == [min(BLOCKED_RETRY_FIRST_S * 2**i, BLOCKED_RETRY_S) for i in range(len(waits))], (
        "first tried again after BLOCKED_RETRY_FIRST_S, each wait twice the last")
    admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, out, configs={"max.message.bytes": "1000000"})])
    state.not_before = 0.0  # its retry is due
    drain(relay)
    assert values(kafka, out) == [b"before", b"x" * 5000, b"after"]
    assert relay.shards_blocked == []
    (shown,) = show_outbox(relay.settings, "refused")
    assert shown.refused is not None and shown.refused.seq == 2  # the last refusal stays, named as past
    assert shown.refusal is not None and shown.refusal.endswith("(published past it since)")
    relay.close()


def test_a_kafka_transaction_that_never_returns_stops_the_relay(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any, monkeypatch: Any) -> None:
    """A publish stuck past its timeout (a librdkafka transactional call was seen to hang
    after a broker restart) cannot be interrupted: the relay stops with RelayStuck, so its worker
    stops and its leases run out, rather than holding the shard unpublished for good."""
    out = new_topic(partitions=1)
    relay = relay_for(engine, kafka, pg_dsn, group="stuck", outbox_shards=1, connect_timeout_s=1)
    release = threading.Event()
    monkeypatch.setattr(publisher_class(_client[0]), "publish", lambda *a, **k: release.wait(120))
    write_batch(engine, relay.outbox, [Produced(out, b"v", b"k")])
    relay.start()
    try:
        wait_until(lambda: relay.error is not None, 60, what="the relay to give up on the stuck shard")
        assert isinstance(relay.error, RelayStuck), relay.error
        assert "shard 0 of group 'stuck'" in str(relay.error)
    finally:
        release.set()
        relay.close()


def test_a_relay_paused_mid_transaction_is_not_judged_stuck_for_the_pause(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any, monkeypatch: Any) -> None:
    """A process paused (SIGSTOP, a frozen VM) while a shard's transaction is under way wakes to a
    clock far past the transaction's timeout. The pause is not the transaction's: the relay does
    not stop with RelayStuck, and the transaction, once it returns, publishes. The pause is made
    by moving the relay's clock on, as a woken process sees it."""
    out = new_topic(partitions=1)
    relay = relay_for(engine, kafka, pg_dsn, group="paused", outbox_shards=1, connect_timeout_s=5, db_timeout_s=2)
    started, release = threading.Event(), threading.Event()
    cls = publisher_class(_client[0])
    publish = cls.publish

    def slow_publish(self: Any, *args: Any, **kwargs: Any) -> None:
        started.set()
        release.wait(60)
        publish(self, *args, **kwargs)

    monkeypatch.setattr(cls, "publish", slow_publish)
    clock = _Clock()
    monkeypatch.setattr(relay_module, "time", clock)
    write_batch(engine, relay.outbox, [Produced(out, b"v", b"k")])
    relay.start()
    try:
        assert started.wait(60), "the shard's transaction to begin"
        clock.offset = 300.0  # the process was stopped for five minutes, 20 times the stuck limit
        wait_until(lambda: relay._paused_s > 250, 30, what="the relay's lease loop to see the pause")
        turned = relay._turned_at
        wait_until(lambda: relay._turned_at > turned or relay.error is not None, 30,
                   what="another turn of the lease loop, the stuck check included")
        assert relay.error is None, relay.error
        release.set()
        wait_until(lambda: values(kafka, out) == [b"v"], 60, what="the transaction to publish")
        assert relay.error is None, relay.error
    finally:
        release.set()
        relay.close()


class _Clock:
    """``time`` as the relay sees it: monotonic time moved on by ``offset``."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


def test_progress_left_in_kafka_by_another_database_counts_for_nothing(
        engine: Any, pg_dsn: str, sqlite_dsn: str, kafka: str, new_topic: Any) -> None:
    """Same group, a database made anew: its rows start at seq 1 again and must all be published."""
    out = new_topic(partitions=1)
    elsewhere = make_engine(Settings(dsn=sqlite_dsn))
    try:
        old = relay_for(elsewhere, kafka, sqlite_dsn, group="reborn")
        write_batch(elsewhere, old.outbox, [Produced(out, f"old{i}".encode(), b"k") for i in range(30)])
        drain(old)
        old.close()
    finally:
        elsewhere.dispose()
    new = relay_for(engine, kafka, pg_dsn, group="reborn")
    write_batch(engine, new.outbox, [Produced(out, f"new{i}".encode(), b"k") for i in range(5)])
    drain(new)
    assert values(kafka, out) == [f"old{i}".encode() for i in range(30)] + [f"new{i}".encode() for i in range(5)]
    new.close()


def test_relays_share_the_shards_and_a_lease_taken_over_fences_the_old_holder(
        engine: Any, pg_dsn: str, kafka: str) -> None:
    one = relay_for(engine, kafka, pg_dsn)
    one.turn()
    assert one.shards_held == [0, 1]
    two = relay_for(engine, kafka, pg_dsn)
    wait_until(lambda: (one.turn(), two.turn()) and one.shards_held and two.shards_held, 30, interval=0.2,
               what="two relays to hold a shard each")
    assert sorted(one.shards_held + two.shards_held) == [0, 1]
    # The database's epoch fences a holder whose lease was taken: its mark lands nowhere.
    shard = one.shards_held[0]
    stale = one._held[shard].epoch
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("UPDATE kstore_outbox_relays SET lease_expires = 0 WHERE shard = :s"), {"s": shard})
    assert two.outbox.claim(two.member, shard, 3) == stale + 1
    assert not one.outbox.mark_published(shard, stale, one.member, {shard: 1})
    assert not one.outbox.holds(one.member, shard, stale)
    wait_until(lambda: (one.turn(), shard not in one.shards_held)[1], 10, interval=0.1,
               what="the old holder to find its lease gone")
    one.close()
    two.close()


def _keyed(shards: int, wanted: set[int], n: int) -> list[bytes]:
    """``n`` keys whose records go to the shards ``wanted`` (of ``shards``)."""
    keys = (f"key-{i}".encode() for i in range(10**6))
    return [k for k in keys if shard_of(Produced("t", None, k), shards) in wanted][:n]


def test_a_lane_publishes_each_of_its_shards_once_per_key_in_commit_order_and_marks_each(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any) -> None:
    """More shards than MAX_LANES: a lane publishes several shards in one Kafka transaction, and its
    progress record names each one's seq. A relay that takes the lane over trusts that record (the
    database's marks are set back here) and publishes only what came after."""
    out = new_topic(partitions=3)
    shards = MAX_LANES + 4
    relay = relay_for(engine, kafka, pg_dsn, group="laned", outbox_shards=shards)
    assert relay.outbox.lanes == MAX_LANES
    keys = _keyed(shards, set(range(shards)), 60)
    sent: dict[bytes, list[int]] = {k: [] for k in keys}
    rng = random.Random(7)
    for _ in range(12):
        records = []
        for key in rng.sample(keys, 20):
            sent[key].append(len(sent[key]))
            records.append(Produced(out, f"{key.decode()}:{sent[key][-1]}".encode(), key))
        write_batch(engine, relay.outbox, records)
    drain(relay)
    assert relay.shards_held == list(range(shards))
    assert relay._held[0].shards == (0, MAX_LANES), "lane 0 publishes shards 0 and MAX_LANES"

    def published() -> dict[bytes, list[int]]:
        got: dict[bytes, list[int]] = {}
        for key, value in read_committed(kafka, out):
            assert key is not None
            got.setdefault(key, []).append(int(value.decode().rpartition(":")[2]))
        return got

    assert published() == {k: v for k, v in sent.items() if v}, "each record once, each key's in order"
    state = {s.shard: s for s in relay.outbox.state()}
    assert all(s.waiting == 0 and s.published_seq == s.next_seq - 1 for s in state.values())
    _, incarnation = relay.outbox.published_marks(0)
    lane0 = [r.value for r in read_committed_records(kafka, progress_topic("laned")) if r.partition == 0]
    assert lane0[-1] == progress_mark(incarnation, {0: state[0].published_seq,
                                                    MAX_LANES: state[MAX_LANES].published_seq})[1]
    assert lane0[-1].decode().startswith(f"{incarnation}/0:"), "one record names both of the lane's shards"
    relay.close()
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("UPDATE kstore_outbox_relays SET published_seq = 0 WHERE consumer_group = 'laned'"))
    more = [Produced(out, f"{k.decode()}:{len(sent[k])}".encode(), k) for k in keys[:10]]
    for k in keys[:10]:
        sent[k].append(len(sent[k]))
    write_batch(engine, relay.outbox, more)
    again = relay_for(engine, kafka, pg_dsn, group="laned", outbox_shards=shards)
    drain(again)
    assert published() == {k: v for k, v in sent.items() if v}, "the next relay went on from Kafka's record"
    again.close()


def test_a_lane_taken_over_fences_its_old_producer(engine: Any, pg_dsn: str, kafka: str, new_topic: Any) -> None:
    """A relay paused while it publishes a lane of several shards loses the lane's lease; the relay
    that takes the lane fences the paused one's producer, which can publish nothing when it wakes."""
    out = new_topic(partitions=1)
    shards = MAX_LANES * 2
    one = relay_for(engine, kafka, pg_dsn, group="lane-fenced", outbox_shards=shards)
    lane0 = set(lane_shards(0, shards))
    keys = _keyed(shards, lane0, 4)
    write_batch(engine, one.outbox, [Produced(out, f"before-{i}".encode(), k) for i, k in enumerate(keys)])
    drain(one)
    paused = one._held.pop(0)  # the paused relay keeps its producer, and knows nothing yet
    assert paused.publisher is not None and set(paused.shards) == lane0
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("UPDATE kstore_outbox_relays SET lease_expires = 0 "
                             "WHERE consumer_group = 'lane-fenced' AND shard = 0"))
    write_batch(engine, one.outbox, [Produced(out, f"after-{i}".encode(), k) for i, k in enumerate(keys)])
    two = relay_for(engine, kafka, pg_dsn, group="lane-fenced", outbox_shards=shards)
    wait_until(lambda: (two.turn(), len(values(kafka, out)) >= 8)[1], 60, interval=0.1,
               what="the second relay to take lane 0 and publish what came after")
    assert 0 in two._held and two._held[0].epoch == paused.epoch + 1
    with pytest.raises(Fenced):
        paused.publisher.publish([Produced(out, b"zombie", keys[0])], {s: 10**6 for s in lane0}, 10)
    assert not one.outbox.mark_published(0, paused.epoch, one.member, {s: 10**6 for s in lane0})
    assert sorted(values(kafka, out)) == sorted([f"before-{i}".encode() for i in range(4)]
                                                + [f"after-{i}".encode() for i in range(4)])
    paused.publisher.close()
    one.close()
    two.close()


def test_a_shard_row_locked_by_a_paused_transaction_holds_up_no_other_lease(
        engine: Any, pg_dsn: str, kafka: str) -> None:
    """A paused relay stopped inside its mark holds its shard's row locked until the database ends its
    session: claiming that shard must not wait for it, or the heartbeat stalls and every other lease
    the relay holds runs out."""
    relay = relay_for(engine, kafka, pg_dsn, outbox_lease_s=1.5)
    blocker = engine.connect()
    tx = blocker.begin()
    blocker.execute(sa.text("UPDATE kstore_outbox_relays SET updated_at = now() WHERE consumer_group = :g "
                            "AND shard = 1"), {"g": GROUP})
    try:
        relay.start()
        wait_until(lambda: relay.shards_held == [0], 15, interval=0.05, what="shard 0 held")
        deadline = time.monotonic() + 3 * 1.5
        while time.monotonic() < deadline:  # three leases long: shard 0's is renewed all along
            lease = {s.shard: s for s in relay.outbox.state()}[0]
            assert lease.owner == relay.member and lease.lease_left_s > 0, lease
            assert 1 not in relay.shards_held
            time.sleep(0.1)
    finally:
        tx.rollback()
        blocker.close()
    wait_until(lambda: relay.shards_held == [0, 1], 15, interval=0.05, what="shard 1 taken once it is unlocked")
    relay.request_stop()
    relay.close()


@pytest.mark.parametrize("seed", range(20))
def test_relays_share_shards_evenly_from_any_start(seed: int) -> None:
    """share(), the rule each relay applies at its heartbeat: from any holding, turns in any order
    end with every shard held and no relay holding two more than another, and then nothing moves."""
    rng = random.Random(seed)
    shards, relays = rng.randint(1, 12), rng.randint(1, 6)
    names = [f"r{i}" for i in range(relays)]
    held = {n: 0 for n in names}
    free = shards
    for _ in range(rng.randint(0, shards)):  # some start holding, unevenly
        held[rng.choice(names)] += 1
        free -= 1
    for _ in range(40):
        for name in rng.sample(names, len(names)):
            action = share(shards, dict(held), name)
            if action < 0:
                held[name] -= 1
                free += 1
            elif action > 0:
                took = min(action, free)
                held[name] += took
                free -= took
    assert free == 0 and sum(held.values()) == shards
    assert max(held.values()) - min(held.values()) <= 1, held
    assert all(share(shards, dict(held), n) >= 0 for n in names), "settled: nobody gives a shard up (none is free)"


def test_shards_made_anew_in_the_same_database_publish_from_their_first_record(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any) -> None:
    """The operator's way to change the shard count: the outbox empty, the group's outbox rows deleted,
    the shards made again. Their numbers start at 1 again; Kafka's old marks must not cover them."""
    out = new_topic(partitions=1)
    first = relay_for(engine, kafka, pg_dsn, group="resharded")
    write_batch(engine, first.outbox, [Produced(out, f"before{i}".encode(), b"k") for i in range(40)])
    drain(first)
    first.close()
    with engine.connect() as conn, conn.begin():
        for table in ("outbox", "outbox_shards", "outbox_relays", "outbox_members"):
            conn.execute(sa.text(f"DELETE FROM kstore_{table} WHERE consumer_group = 'resharded'"))
    again = relay_for(engine, kafka, pg_dsn, group="resharded", outbox_shards=3)
    assert again.outbox.shards == 3
    write_batch(engine, again.outbox, [Produced(out, f"after{i}".encode(), b"k") for i in range(5)])
    drain(again)
    assert values(kafka, out)[40:] == [f"after{i}".encode() for i in range(5)]
    again.close()


def test_a_progress_mark_read_past_its_end_counts_for_nothing() -> None:
    """confluent-kafka reads a committed offset's metadata that has no NUL at its end past that end: such
    a mark must never read as further than it is (rows would be skipped), so only a mark whose metadata
    is exactly its incarnation and its own offset counts."""
    committed = {("a", 0): Committed(13, "inc/13"), ("b", 0): Committed(15, "inc/135 V"),
                 ("c", 0): Committed(40, "inc/4000"), ("d", 0): Committed(20, "old/20"),
                 ("e", 0): Committed(9, "inc/9")}
    assert highest_mark(committed, "inc/") == 13
    assert highest_mark({}, "inc/") == 0


def earlier_relay_published(kafka: str, group: str, shard: int, incarnation: str, rows: list[Any]) -> None:
    """Publish rows as relays of earlier versions did: the shard's progress committed, in the same
    transaction, as the offset of a group of its own (metadata ``<incarnation>/<seq>``)."""
    import confluent_kafka

    ident = shard_id(group, shard)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka, "transactional.id": ident})
    meta = confluent_kafka.Consumer({"bootstrap.servers": kafka, "group.id": ident})
    producer.init_transactions(30)
    producer.begin_transaction()
    for row in rows:
        producer.produce(row.record.topic, value=row.record.value, key=row.record.key)
    last = rows[-1].seq
    mark = confluent_kafka.TopicPartition(rows[0].record.topic, 0, last, f"{incarnation}/{last}")
    producer.send_offsets_to_transaction([mark], meta.consumer_group_metadata(), 30)
    producer.commit_transaction(30)
    meta.close()


def test_a_relay_upgraded_mid_stream_goes_on_from_the_mark_an_earlier_version_left(
        engine: Any, pg_dsn: str, kafka: str, new_topic: Any) -> None:
    """An earlier version published rows 1-18 and its relay stopped before the database's mark: the
    upgraded relay reads that mark (a group's offset) once and publishes from row 19; from then on its
    progress is the last record of the shard's partition of the progress topic, which the next relay
    reads."""
    out = new_topic(partitions=1)
    relay = relay_for(engine, kafka, pg_dsn, group="upgraded", outbox_shards=1)
    write_batch(engine, relay.outbox, [Produced(out, f"r{i}".encode(), b"k") for i in range(30)])
    rows = relay.outbox.pending({0: 0}, 100)
    _, incarnation = relay.outbox.published_marks(0)
    earlier_relay_published(kafka, "upgraded", 0, incarnation, rows[:18])
    assert values(kafka, out) == [f"r{i}".encode() for i in range(18)]
    assert relay.outbox.published_marks(0)[0] == {0: 0}, "the database's mark is behind: only Kafka's can be trusted"
    drain(relay)
    assert values(kafka, out) == [f"r{i}".encode() for i in range(30)]
    relay.close()
    progress = [v for _, v in read_committed(kafka, progress_topic("upgraded"))]
    assert progress[-1] == f"{incarnation}/30".encode()
    # The next relay's producer starts from the progress topic (the old mark still says 18).
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("UPDATE kstore_outbox_relays SET published_seq = 0 WHERE consumer_group = 'upgraded'"))
    write_batch(engine, relay.outbox, [Produced(out, f"r{i}".encode(), b"k") for i in range(30, 35)])
    again = relay_for(engine, kafka, pg_dsn, group="upgraded", outbox_shards=1)
    drain(again)
    assert values(kafka, out) == [f"r{i}".encode() for i in range(35)]
    again.close()
