"""The stub cluster behind the seam (kstore.kafka.stub): its logs, its group's eager rebalances and
expulsions, the consumer's seek and pause semantics, its admin answers, and a worker running on it."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import ClassVar

import pytest
import sqlalchemy as sa

from kstore import Message, Processor, Settings, Worker, migrate
from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.seam import MIRROR_METADATA, NO_POSITION, Committed, ConsumerSource, GroupView, Refused
from kstore.kafka.stub import DeferringStubSource, StubCluster, StubSource
from kstore.types import TopicPartition as TP

GROUP = "g"
SETTINGS = Settings(dsn="sqlite://", bootstrap_servers="stub:9092")


class Events:
    """What a source posted to the engine, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[TP]]] = []

    def __call__(self, kind: str, tps: list[TP]) -> None:
        self.seen.append((kind, tps))

    def take(self) -> list[tuple[str, list[TP]]]:
        seen, self.seen = self.seen, []
        return seen


def _cluster(partitions: int = 2, **kwargs: object) -> StubCluster:
    cluster = StubCluster(blocking=False, **kwargs)  # type: ignore[arg-type]
    cluster.create_topic("t", partitions)
    return cluster


def _join(cluster: StubCluster, name: str) -> tuple[StubSource, Events]:
    source = cluster.source(Settings(dsn="sqlite://", bootstrap_servers="stub:9092", client_id=name), GROUP, ["t"],
                            f"worker-{name}")
    assert isinstance(source, StubSource)
    events = Events()
    source.subscribe(events)
    return source, events


def _join_deferring(cluster: StubCluster, name: str) -> tuple[DeferringStubSource, Events]:
    source = cluster.deferring_source(Settings(dsn="sqlite://", bootstrap_servers="stub:9092", client_id=name), GROUP,
                                      ["t"], f"worker-{name}")
    assert isinstance(source, DeferringStubSource) and source.callbacks_may_lock
    events = Events()
    source.subscribe(events)
    return source, events


def _place(source: ConsumerSource, offsets: dict[TP, int]) -> None:
    """What the engine's claim does: seek each partition to its stored offset and resume it."""
    for tp, offset in offsets.items():
        source.seek(tp, offset)
    source.resume(list(offsets))


def _offsets(source: ConsumerSource, max_records: int = 100) -> dict[TP, list[int]]:
    return {tp: [r.offset for r in records] for tp, records in source.fetch(0, max_records).records}


# -- logs ---------------------------------------------------------------------------------------------

def test_a_log_keeps_dense_offsets_keys_headers_and_the_clocks_timestamps() -> None:
    cluster = StubCluster(clock=lambda: 1_700_000_000.5)
    cluster.create_topic("t", 1)
    assert cluster.produce("t", 0, b"a") == 0
    assert cluster.produce("t", 0, b"b", key=b"k", headers=[("h", b"1")], timestamp_ms=5) == 1
    first, second = cluster.records(("t", 0))
    assert (first.offset, first.value, first.key, first.timestamp_ms) == (0, b"a", None, 1_700_000_000_500)
    assert (second.offset, second.key, tuple(second.headers), second.timestamp_ms) == (1, b"k", (("h", b"1"),), 5)
    with pytest.raises(KeyError):
        cluster.produce("t", 1, b"no such partition")


def test_deleting_records_moves_the_log_start_and_keeps_the_offsets() -> None:
    cluster = _cluster(1)
    for i in range(5):
        cluster.produce("t", 0, str(i).encode())
    cluster.delete_records("t", 0, 3)
    assert (cluster.start(("t", 0)), cluster.end(("t", 0))) == (3, 5)
    assert [r.offset for r in cluster.records(("t", 0))] == [3, 4]
    assert cluster.value(("t", 0), 4) == b"4"


# -- the group: eager rebalances ---------------------------------------------------------------------------

def test_the_first_member_is_given_every_partition_paused_and_reports_it() -> None:
    cluster = _cluster(2)
    cluster.produce("t", 0, b"x")
    a, events = _join(cluster, "a")
    assert a.fetch(0, 10).records == [], "nothing is fetched before the engine places the partitions"
    assert events.take() == [("assigned", [("t", 0), ("t", 1)])]
    assert a.assignment() == {("t", 0), ("t", 1)}
    assert a.joins == 1 and a.member_id is not None and a.member_id.startswith("a-")
    assert a.group_stable()


def test_a_second_member_joining_revokes_everything_then_splits_the_partitions() -> None:
    cluster = _cluster(4)
    a, a_events = _join(cluster, "a")
    a.fetch(0, 10)
    a_events.take()
    b, b_events = _join(cluster, "b")
    b.fetch(0, 10)  # joins: the rebalance waits for a
    assert b_events.take() == [] and not b.group_stable()
    assert not cluster.group(GROUP).view().settled
    a.fetch(0, 10)  # a's join step: it revokes everything, and the group completes
    assert a_events.take()[0] == ("revoked", [("t", 0), ("t", 1), ("t", 2), ("t", 3)])
    b.fetch(0, 10)
    assigned_a, assigned_b = a.assignment(), b.assignment()
    assert assigned_a | assigned_b == {("t", p) for p in range(4)} and not assigned_a & assigned_b
    assert len(assigned_a) == len(assigned_b) == 2
    assert b_events.take() == [("assigned", sorted(assigned_b))]
    assert cluster.group(GROUP).generation == 2
    view = cluster.group(GROUP).view()
    assert view.settled and view.owners() == {**dict.fromkeys(assigned_a, "a"), **dict.fromkeys(assigned_b, "b")}


def test_a_member_that_closes_revokes_and_leaves_and_the_other_takes_everything() -> None:
    cluster = _cluster(2)
    a, _ = _join(cluster, "a")
    b, b_events = _join(cluster, "b")
    for source in (a, b, a, b):
        source.fetch(0, 10)
    b_events.take()
    a.close()
    b.fetch(0, 10)
    assert b_events.take()[-1] == ("assigned", [("t", 0), ("t", 1)])
    assert [m.client_id for m in cluster.group(GROUP).view().members] == ["b"]
    b.close()
    assert cluster.group(GROUP).view() == GroupView((), False), "Kafka's Empty: no member, nothing settled"
    assert cluster.admin().group_view("unknown") == GroupView((), False)


def test_an_expelled_member_hears_of_it_only_at_its_next_fetch_as_a_loss_then_joins_again() -> None:
    cluster = _cluster(2)
    a, a_events = _join(cluster, "a")
    a.fetch(0, 10)
    a_events.take()
    old_id = a.member_id
    assert old_id is not None
    cluster.expel(GROUP, old_id)
    assert a.assignment() == {("t", 0), ("t", 1)}, "a zombie still believes it owns its partitions"
    assert cluster.group(GROUP).view().members == ()
    a.fetch(0, 10)
    assert a_events.take() == [("lost", [("t", 0), ("t", 1)]), ("assigned", [("t", 0), ("t", 1)])]
    assert a.member_id != old_id, "a member joining again gets a new member id"


def test_with_an_rng_an_expelled_member_may_fetch_its_old_partitions_before_it_hears() -> None:
    found_zombie_fetch = False
    for seed in range(20):
        cluster = _cluster(1, rng=random.Random(seed))
        cluster.produce("t", 0, b"x")
        a, events = _join(cluster, "a")
        a.fetch(0, 10)
        _place(a, {("t", 0): 0})
        assert a.member_id is not None
        cluster.expel(GROUP, a.member_id)
        events.take()
        if _offsets(a) == {("t", 0): [0]}:
            found_zombie_fetch = True
            assert events.take() == [], "it fetched without its join step: it has not heard yet"
    assert found_zombie_fetch


def test_io_step_runs_the_join_step_without_fetching() -> None:
    cluster = _cluster(1)
    cluster.produce("t", 0, b"x")
    a, events = _join(cluster, "a")
    assert a.consumer.io_step()
    assert events.take() == [("assigned", [("t", 0)])]
    assert not a.consumer.io_step(), "nothing changed: no listener call"


# -- seek, pause, resume --------------------------------------------------------------------------------

def test_a_partition_given_has_no_position_until_sought_and_is_refused_if_resumed_without_one() -> None:
    cluster = _cluster(1)
    cluster.produce("t", 0, b"x")
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    assert a.positions([("t", 0)]) == {}
    a.resume([("t", 0)])
    assert a.fetch(0, 10).refused == [Refused(("t", 0), NO_POSITION)]
    assert a.fetch(0, 10).refused == [], "a refused partition is paused: refused once"


def test_a_sought_and_resumed_partition_fetches_from_its_position_and_moves_it() -> None:
    cluster = _cluster(1)
    for i in range(5):
        cluster.produce("t", 0, str(i).encode())
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    _place(a, {("t", 0): 2})
    assert _offsets(a, max_records=2) == {("t", 0): [2, 3]}
    assert a.positions([("t", 0)]) == {("t", 0): 4}
    assert a.highwater(("t", 0)) == 5
    a.pause([("t", 0)])
    assert _offsets(a) == {}, "paused: nothing fetched"
    a.resume([("t", 0)])
    a.seek(("t", 0), 1)
    assert _offsets(a) == {("t", 0): [1, 2, 3, 4]}


def test_a_position_outside_the_log_is_refused_never_reset() -> None:
    cluster = _cluster(1)
    for i in range(4):
        cluster.produce("t", 0, str(i).encode())
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    _place(a, {("t", 0): 1})
    cluster.delete_records("t", 0, 3)
    assert a.fetch(0, 10).refused == [Refused(("t", 0), 1)]
    assert a.positions([("t", 0)]) == {("t", 0): 1}, "the position stays where it was"


def test_seek_pause_and_resume_skip_a_partition_not_assigned() -> None:
    cluster = _cluster(1)
    a, _ = _join(cluster, "a")
    a.seek(("t", 0), 3)
    a.pause([("t", 0)])
    a.resume([("t", 0)])
    a.release([("t", 0)])
    assert a.assignment() == set() and a.positions([("t", 0)]) == {}


def test_release_pauses_what_is_still_assigned() -> None:
    cluster = _cluster(1)
    cluster.produce("t", 0, b"x")
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    _place(a, {("t", 0): 0})
    a.release([("t", 0)])
    assert _offsets(a) == {}


def test_the_same_rng_seed_gives_the_same_fetches() -> None:
    def run(seed: int) -> list[dict[TP, list[int]]]:
        cluster = _cluster(3, rng=random.Random(seed))
        for p in range(3):
            for i in range(6):
                cluster.produce("t", p, str(i).encode())
        a, _ = _join(cluster, "a")
        a.fetch(0, 10)
        _place(a, {("t", p): 0 for p in range(3)})
        return [_offsets(a, max_records=4) for _ in range(6)]

    assert run(1) == run(1)
    assert any(run(1) != run(seed) for seed in range(2, 6)), "the rng makes the fetches' choices"


def test_a_blocking_fetch_waits_for_a_record_produced_meanwhile() -> None:
    cluster = StubCluster()
    cluster.create_topic("t", 1)
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    _place(a, {("t", 0): 0})
    timer = threading.Timer(0.05, lambda: cluster.produce("t", 0, b"late"))
    timer.start()
    started = time.monotonic()
    try:
        assert _fetch_offsets(a, timeout_ms=5000) == {("t", 0): [0]}
    finally:
        timer.cancel()
    assert time.monotonic() - started < 4


def _fetch_offsets(source: ConsumerSource, timeout_ms: int) -> dict[TP, list[int]]:
    return {tp: [r.offset for r in records] for tp, records in source.fetch(timeout_ms, 10).records}


# -- confluent-kafka's threading: callbacks inside a fetch, seeks and pauses deferred to the next -------

def test_a_deferring_source_carries_out_seeks_and_resumes_at_its_next_fetch() -> None:
    cluster = _cluster(1)
    for i in range(3):
        cluster.produce("t", 0, str(i).encode())
    a, events = _join_deferring(cluster, "a")
    a.fetch(0, 10)
    assert events.take() == [("assigned", [("t", 0)])]
    _place(a, {("t", 0): 1})
    assert a.positions([("t", 0)]) == {}, "a wish: not carried out before the next fetch"
    assert _offsets(a) == {("t", 0): [1, 2]}
    a.seek(("t", 0), 0)
    a.pause([("t", 0)])
    a.resume([("t", 0)])  # the last wish wins
    assert _offsets(a) == {("t", 0): [0, 1, 2]}


def test_a_deferring_source_forgets_the_seek_and_resume_of_a_partition_it_released() -> None:
    cluster = _cluster(1)
    cluster.produce("t", 0, b"x")
    a, _ = _join_deferring(cluster, "a")
    a.fetch(0, 10)
    _place(a, {("t", 0): 0})
    a.release([("t", 0)])
    assert _offsets(a) == {} and a.positions([("t", 0)]) == {}


def test_a_deferring_source_hears_of_rebalances_only_inside_its_fetch_and_drops_a_revoked_partition_at_once() -> None:
    cluster = _cluster(2)
    a, a_events = _join_deferring(cluster, "a")
    assert not a.consumer.io_step(), "no background thread takes the join step"
    a.fetch(0, 10)
    a_events.take()
    assigned_when_revoked: list[set[TP]] = []
    a._post = lambda kind, tps: assigned_when_revoked.append(a.assignment()) if kind == "revoked" else None
    b, _ = _join_deferring(cluster, "b")
    b.fetch(0, 10)
    assert not a.consumer.io_step() and assigned_when_revoked == []
    a.fetch(0, 10)
    assert assigned_when_revoked == [set()], "eager: a revoke unassigns everything at once"
    assert len(a.assignment()) == 1, "then the group completed and gave a its share"


def test_check_topics_names_a_missing_topic() -> None:
    cluster = _cluster(1)
    source = cluster.source(SETTINGS, GROUP, ["t", "missing"], "w")
    with pytest.raises(ConfigurationError, match=r"unknown topic\(s\) missing"):
        source.check_topics()


def test_mirrored_offsets_are_committed_with_their_marker_for_assigned_partitions_only() -> None:
    cluster = _cluster(2)
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    a.mirror({("t", 0): 7, ("u", 0): 1})
    a.flush_mirror()
    assert cluster.admin().committed(GROUP) == {("t", 0): Committed(7, MIRROR_METADATA)}


# -- the admin --------------------------------------------------------------------------------------------

def test_the_admin_answers_bounds_times_values_and_counts() -> None:
    cluster = StubCluster(blocking=False)
    cluster.create_topic("t", 2)
    for i, ms in enumerate((1000, 2000, 3000)):
        cluster.produce("t", 0, f"v{i}".encode(), timestamp_ms=ms)
    admin = cluster.admin()
    assert admin.partitions("t") == [0, 1] and admin.partitions("nope") == []
    assert admin.log_bounds([("t", 0), ("t", 1)]) == {("t", 0): (0, 3), ("t", 1): (0, 0)}
    with pytest.raises(BrokerError):
        admin.log_bounds([("nope", 0)])
    at = datetime.fromtimestamp(1.5, timezone.utc)
    assert admin.offsets_for_times({("t", 0): at, ("t", 1): at}) == {("t", 0): 1, ("t", 1): None}
    assert admin.last_values([("t", 0), ("t", 1)], 1.0) == {("t", 0): b"v2", ("t", 1): None}
    assert admin.first_timestamps({("t", 0): 2, ("t", 1): 0}, 1.0) == {("t", 0): 3000}
    assert admin.partition_counts(["t", "nope"]) == {"t": 2, "nope": 0}
    assert admin.create_missing(["t", "new"], 3, None) == (["new"], {"t": 2, "new": 3})
    admin.add_partitions("t", 4)
    assert admin.partitions("t") == [0, 1, 2, 3]


def test_offsets_are_committed_with_metadata_only_while_the_group_has_no_live_member() -> None:
    cluster = _cluster(1)
    admin = cluster.admin()
    admin.commit(GROUP, {("t", 0): 5}, "kstore-reset")
    assert admin.committed(GROUP) == {("t", 0): Committed(5, "kstore-reset")}
    a, _ = _join(cluster, "a")
    a.fetch(0, 10)
    with pytest.raises(BrokerError, match="refused the offsets of group 'g'"):
        admin.commit(GROUP, {("t", 0): 6}, "")
    assert [m.client_id for m in admin.group_view(GROUP).members] == ["a"]


# -- a worker on the stub --------------------------------------------------------------------------------

seen = sa.Table("stub_seen", sa.MetaData(), sa.Column("kafka_offset", sa.Integer), sa.Column("value", sa.LargeBinary))


class Recorder(Processor):
    group: ClassVar[str | None] = GROUP
    topics: ClassVar[Sequence[str]] = ("t",)

    def handle(self, msg: Message) -> None:
        self.session.execute(seen.insert(), {"kafka_offset": msg.offset, "value": msg.value})


def test_a_worker_runs_on_the_stub_and_commits_each_record_once(tmp_path: Path) -> None:
    dsn = f"sqlite:///{tmp_path / 'stub.db'}"
    migrate(Settings(dsn=dsn))
    engine = sa.create_engine(dsn)
    seen.metadata.create_all(engine)
    cluster = StubCluster(blocking=False)
    cluster.create_topic("t", 2)
    for i in range(6):
        cluster.produce("t", i % 2, f"m{i}".encode())
    worker = Worker(Recorder(), Settings(dsn=dsn, bootstrap_servers="stub:9092", relay=False))
    worker.source_factory = cluster.source
    worker.start()
    try:
        for _ in range(20):
            worker.fetch_once()
            worker.step()
    finally:
        worker.close()
    with engine.connect() as conn:
        values = sorted(conn.execute(sa.select(seen.c.value)).scalars())
        stored = {p: n for p, n in conn.execute(sa.text("SELECT partition_id, next_offset FROM kstore_offsets"))}
    engine.dispose()
    assert values == [f"m{i}".encode() for i in range(6)]
    assert stored == {0: 3, 1: 3}


def test_a_running_worker_processes_everything_on_a_blocking_stub(tmp_path: Path) -> None:
    """``Worker.run``: its fetch thread and main thread call the stub at once; fetches wait for records."""
    dsn = f"sqlite:///{tmp_path / 'stub.db'}"
    migrate(Settings(dsn=dsn))
    engine = sa.create_engine(dsn)
    seen.metadata.create_all(engine)
    cluster = StubCluster()
    cluster.create_topic("t", 2)
    for i in range(10):
        cluster.produce("t", i % 2, f"m{i}".encode())
    worker = Worker(Recorder(), Settings(dsn=dsn, bootstrap_servers="stub:9092", relay=False, poll_timeout_ms=100))
    worker.source_factory = cluster.source
    worker.run(idle_timeout=0.5)
    with engine.connect() as conn:
        values = sorted(conn.execute(sa.select(seen.c.value)).scalars())
    engine.dispose()
    assert values == sorted(f"m{i}".encode() for i in range(10))
    assert cluster.group(GROUP).view().members == (), "the worker left the group when it stopped"
