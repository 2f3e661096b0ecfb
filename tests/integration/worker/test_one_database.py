"""One pipeline, one database: a worker of a group pointed at another database than the
group's is refused (before it claims anything), and `kstore offsets show` on a database
names only owners that write to it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaConsumer
from kafka.coordinator.assignors.abstract import ConsumerProtocolAssignment, ConsumerProtocolSubscription
from kafka.coordinator.assignors.range import RangePartitionAssignor

from kstore.db.members import GroupMembers, Registered
from kstore.engine.onedatabase import established_in_group, unknown_members
from kstore.kafka.kafkapython.members import GroupMember
from kstore.settings import default_rebalance_protocol
from tests.support.harness import SUPPORT_DIR, assert_exactly_once, effects, stored_offsets, wait_until


def show(dsn: str, group: str, kafka: str) -> dict[int, Any]:
    r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "show", "--group", group, "--dsn", dsn,
                        "--bootstrap-servers", kafka, "--json"], capture_output=True, text=True, cwd=SUPPORT_DIR,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return {row["partition"]: row for row in json.loads(r.stdout)}


@pytest.mark.contract
def test_a_worker_on_another_database_is_refused_and_not_named_owner(kafka: str, pg_dsn: str, sqlite_dsn: str,
                                                                    new_topic: Any, produce: Any,
                                                                    workers: Any) -> None:
    topic = new_topic(2)
    group = f"one-db-{topic}"
    first = set(produce(topic, [f"a{i}" for i in range(10)]))
    # A pipeline once ran on SQLite (its offsets are there), then moved to PostgreSQL.
    old = workers(sqlite_dsn, topic, group)
    wait_until(lambda: len(effects(sqlite_dsn)) >= len(first), 60, what="the SQLite run")
    assert old.terminate() == 0
    main = workers(pg_dsn, topic, group)
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the PostgreSQL worker's first messages")
    assert all(row["owner"] for row in show(pg_dsn, group, kafka).values())
    assert not any(row["owner"] for row in show(sqlite_dsn, group, kafka).values()), "named another database's owner"

    # A worker still pointed at the old database joins: refused, one line, exit 2, nothing claimed.
    stray = workers(sqlite_dsn, topic, group)
    assert stray.proc.wait(timeout=60) == 2
    assert "is already consumed by workers writing to another database" in stray.log
    assert "claimed " in main.log  # the line a claim logs, absent from the stray's
    assert "claimed " not in stray.log.split("INFO kstore.engine.worker: worker ")[-1]
    assert "writes to another database" in main.log  # the group's leader said so too
    more = set(produce(topic, [f"b{i}" for i in range(20)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | more), 60, what="the later messages")
    assert main.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | more)
    assert_exactly_once(effects(sqlite_dsn), first)


def gated(workers: Any, gate: Path, *started: tuple[str, str, str, dict[str, str]]) -> list[Any]:
    """Start workers that wait in setup() (before joining their group) until the gate opens, and open
    it once each is waiting: they join the group at the same moment."""
    procs = [workers(dsn, topic, group, env={**env, "KSTORE_TEST_START_GATE": str(gate)})
             for dsn, topic, group, env in started]
    for proc in procs:
        proc.wait_for_log(r"worker \S+ for group")  # logged just before setup()
    gate.touch()
    return procs


HOLDER = "one-db-holder"


class _HoldAll(RangePartitionAssignor):  # type: ignore[misc]
    """The assignor of the test's own member (the group's leader): every partition to itself, none
    to the workers, so that they claim nothing while the test gathers them in one group."""

    name = "range"

    @classmethod
    def named(cls, name: str) -> type[_HoldAll]:
        """The same assignor under ``name``: the brokers admit only members that share an assignor's name
        (kafka-python has no cooperative protocol, but the workers get nothing from this one to give back)."""
        return type(f"_HoldAll_{name}", (cls,), {"name": name})

    @classmethod
    def metadata(cls, topics: Any) -> Any:
        return ConsumerProtocolSubscription(cls.version, list(topics), HOLDER.encode())

    @classmethod
    def assign(cls, cluster: Any, members: Any) -> Any:
        holder = [m for m in members if m.metadata.user_data == HOLDER.encode()]
        assignment = super().assign(cluster, holder)
        for m in members:
            assignment.setdefault(m.member_id, ConsumerProtocolAssignment(cls.version, [], b""))
        return assignment


@contextlib.contextmanager
def group_leader(kafka: str, topic: str, group: str, dsns: Sequence[str], client: str) -> Iterator[None]:
    """A member of ``group`` that leads it (it joined first) and holds every partition, kept alive by a
    thread; registered in each database's registry as a worker it knows, though it never claims. Its
    assignor is named as the default one of the workers' ``client``."""
    for dsn in dsns:
        engine = sa.create_engine(dsn)
        try:
            GroupMembers(engine, group).register(HOLDER)
        finally:
            engine.dispose()
    assignor = "cooperative-sticky" if default_rebalance_protocol(client) == "cooperative" else "range"
    consumer = KafkaConsumer(bootstrap_servers=kafka, group_id=group, client_id=HOLDER, enable_auto_commit=False,
                             session_timeout_ms=6000, heartbeat_interval_ms=1000,
                             partition_assignment_strategy=[_HoldAll.named(assignor)])
    # An assignor that runs before the holder's metadata knows the new topic assigns nothing, for good.
    wait_until(lambda: consumer.partitions_for_topic(topic), 30, what="the topic in the holder's metadata")
    consumer.subscribe([topic])
    stop = threading.Event()

    def assigned() -> Any:
        consumer.poll(timeout_ms=100)
        return consumer.assignment()

    wait_until(assigned, 60, interval=0, what="the holder to lead the group and hold every partition")
    consumer.pause(*consumer.assignment())

    def keep_alive() -> None:
        while not stop.is_set():
            consumer.poll(timeout_ms=100)
            consumer.pause(*consumer.assignment())

    thread = threading.Thread(target=keep_alive, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        consumer.close(autocommit=False)


@pytest.mark.contract
def test_workers_that_join_together_on_two_databases_both_refuse(kafka: str, pg_dsn: str, sqlite_dsn: str,
                                                                 new_topic: Any, produce: Any, workers: Any,
                                                                 kafka_client: str) -> None:
    """Neither has claimed anything when each sees the other: neither goes on (refusing one side only
    would have to guess which database the pipeline is meant for)."""
    topic = new_topic(2)
    group = f"one-db-together-{topic}"
    produce(topic, [f"a{i}" for i in range(10)])
    with group_leader(kafka, topic, group, [pg_dsn, sqlite_dsn], kafka_client):
        on_pg = workers(pg_dsn, topic, group)
        on_sqlite = workers(sqlite_dsn, topic, group)
        for proc, other in ((on_pg, on_sqlite), (on_sqlite, on_pg)):
            assert proc.proc.wait(timeout=60) == 2, proc.log
            assert "is already consumed by workers writing to another database" in proc.log
            assert f"(client id {other.name})" in proc.log, "named the other worker"
            assert HOLDER not in proc.log.split("is already consumed")[-1], "a member its database knows, named"
            assert "claimed " not in proc.log
    for dsn in (pg_dsn, sqlite_dsn):
        assert not effects(dsn)
        assert not stored_offsets(dsn, group)


@pytest.mark.contract
def test_a_worker_with_its_own_client_id_is_judged_by_its_member_id(pg_dsn: str, sqlite_dsn: str, new_topic: Any,
                                                                    produce: Any, workers: Any) -> None:
    """With ``client_id`` set, every worker has the same client id: the registry knows them by member id."""
    topic, named = new_topic(2), {"KSTORE_CLIENT_ID": "billing"}
    group = f"one-db-client-id-{topic}"
    first = set(produce(topic, [f"a{i}" for i in range(10)]))
    main = workers(pg_dsn, topic, group, env=named)
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the first worker's messages")
    # A second worker on the same database: not refused, and it takes its share.
    second = workers(pg_dsn, topic, group, env=named)
    second.wait_for_log("claimed ")
    assert second.proc.poll() is None
    assert "writes to another database" not in main.log + second.log
    # One on another database, under the same client id: refused, nothing claimed.
    stray = workers(sqlite_dsn, topic, group, env=named)
    assert stray.proc.wait(timeout=60) == 2, stray.log
    assert "is already consumed by workers writing to another database" in stray.log
    assert "claimed " not in stray.log
    more = set(produce(topic, [f"b{i}" for i in range(20)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | more), 60, what="the later messages")
    assert main.terminate() == 0 and second.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | more)
    assert not effects(sqlite_dsn) and not stored_offsets(sqlite_dsn, group)


@pytest.mark.contract
def test_a_restarted_worker_of_the_pipeline_is_not_refused_while_a_stray_is(pg_dsn: str, sqlite_dsn: str,
                                                                            new_topic: Any, produce: Any,
                                                                            workers: Any, tmp_path: Path) -> None:
    topic = new_topic(2)
    group = f"one-db-restart-{topic}"
    first = set(produce(topic, [f"a{i}" for i in range(10)]))
    staying, leaving = workers(pg_dsn, topic, group), workers(pg_dsn, topic, group)
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the pipeline's first messages")
    for worker in (staying, leaving):  # both established (each claimed a partition), whoever joined first
        worker.wait_for_log("claimed ")
    assert leaving.kill() != 0  # a crash: its registry row stays until it goes stale
    # Its replacement and a stray on another database join at the same moment.
    restarted, stray = gated(workers, tmp_path / "gate", (pg_dsn, topic, group, {}), (sqlite_dsn, topic, group, {}))
    assert stray.proc.wait(timeout=60) == 2, stray.log
    assert "is already consumed by workers writing to another database" in stray.log
    more = set(produce(topic, [f"b{i}" for i in range(20)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | more), 60, what="the later messages")
    assert restarted.proc.poll() is None, restarted.log
    assert "is already consumed" not in restarted.log
    assert staying.terminate() == 0
    restarted.wait_for_log("claimed ")  # it takes over every partition: it was never refused
    more2 = set(produce(topic, [f"c{i}" for i in range(10)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | more | more2), 60, what="the last messages")
    assert restarted.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | more | more2)
    assert not effects(sqlite_dsn) and not stored_offsets(sqlite_dsn, group)


def test_a_member_is_known_by_its_name_or_its_member_id_and_never_by_a_shared_client_id() -> None:
    registered = [Registered("kstore-a", None, True), Registered("kstore-b", "id-b", False)]
    members = [GroupMember("id-a", "kstore-a"), GroupMember("id-b", "billing"), GroupMember("id-me", "billing"),
               GroupMember("id-x", "billing"), GroupMember("id-old", "x", told_database="db-1"),
               GroupMember("id-other", "y", told_database="db-2")]
    unknown = unknown_members(members, registered, "db-1", me="id-me")
    assert [m.member_id for m in unknown] == ["id-x", "id-other"]


def test_only_an_established_worker_in_the_group_now_lets_a_new_one_go_on() -> None:
    """A crashed worker's row stays until it goes stale: it must not outvote a stray that joined since."""
    crashed = Registered("kstore-crashed", "id-crashed", True)
    joining = Registered("kstore-me", None, False)
    stray = GroupMember("id-stray", "kstore-elsewhere")
    assert not established_in_group([crashed, joining], [stray, GroupMember("id-me", "kstore-me")], "kstore-me")
    assert established_in_group([crashed, joining], [stray, GroupMember("id-crashed", "x")], "kstore-me")
    assert established_in_group([crashed, joining], [GroupMember("id-9", "kstore-crashed")], "kstore-me")
    assert not established_in_group([Registered("kstore-me", "id-me", True)], [GroupMember("id-me", "kstore-me")],
                                    "kstore-me"), "itself does not count"
    assert not established_in_group([Registered("kstore-idle", "id-idle", False)],
                                    [GroupMember("id-idle", "kstore-idle")], "kstore-me"), "it never claimed"
