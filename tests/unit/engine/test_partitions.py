"""The engine's one owner of per-partition state (kstore.engine.partitions.Partitions): its invariants
under any order of claims, fetches, batches, requeues, holds, fences and revokes, and what it tells the
client. No broker, no database: a scripted client that records what it is told. The transitions
themselves, allowed and refused, are in test_partitions_state.py."""

from __future__ import annotations

import threading
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kstore import Settings
from kstore.engine.partitions import Owned, Partitions, Status
from kstore.kafka.seam import NO_POSITION, Fetched, Refused

TPS = [("t", 0), ("t", 1), ("t", 2)]


class Rec:
    """A fetched record: what the queues read of one."""

    def __init__(self, tp: tuple[str, int], offset: int) -> None:
        self.topic, self.partition, self.offset = tp[0], tp[1], offset
        self.key, self.value, self.headers, self.timestamp = None, b"v", (), 0

    def __repr__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


class Client:
    """Records what the engine tells it; answers positions from a script."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.at: dict[tuple[str, int], int] = {}

    @staticmethod
    def size_of(records: Any) -> int:
        return 100 * len(records)

    def seek(self, tp: Any, offset: int) -> None:
        self.calls.append(("seek", (tp, offset)))

    def pause(self, tps: Any) -> None:
        self.calls.append(("pause", sorted(tps)))

    def resume(self, tps: Any) -> None:
        self.calls.append(("resume", sorted(tps)))

    def release(self, tps: Any) -> None:
        self.calls.append(("release", sorted(tps)))

    def positions(self, tps: Any) -> dict[Any, int]:
        return {tp: self.at[tp] for tp in tps if tp in self.at}

    def highwater(self, tp: Any) -> int | None:
        return None


def make(max_buffered_bytes: int = 1_000_000) -> tuple[Partitions, Client]:
    """Partitions of a worker Kafka assigned TPS (pending: claimed by the tests' own())."""
    client = Client()
    p = Partitions(Settings(max_buffered_bytes=max_buffered_bytes), client)  # type: ignore[arg-type]
    p.assign(TPS)
    return p, client


def test_owning_seeks_and_resumes_and_revoking_releases_the_partition() -> None:
    p, client = make()
    p.own(TPS[0], Owned(3, 40), 40)
    assert client.calls == [("seek", (TPS[0], 40)), ("resume", [TPS[0]])]
    assert p.owned == {TPS[0]: Owned(3, 40)} and p.generation(TPS[0]) is not None
    assert p.revoke([TPS[0]]) == [TPS[0]]
    assert client.calls[-1] == ("release", [TPS[0]])
    assert p.owned == {} and p.generation(TPS[0]) is None
    p.check()


def test_holding_a_partition_takes_it_out_of_owned_and_pending_and_releases_it() -> None:
    p, client = make()
    p.own(TPS[0], Owned(1, 0), 0)
    p.hold(TPS[0], 2)
    assert p.held == {TPS[0]: 2} and TPS[0] not in p.owned and TPS[0] not in p.pending
    assert client.calls[-1] == ("release", [TPS[0]])
    p.check()


def test_fencing_flushes_and_releases_and_remembers_when() -> None:
    p, client = make()
    p.own(TPS[0], Owned(1, 0), 0)
    p.queue_fetched(p.generations(), Fetched([(TPS[0], [Rec(TPS[0], o) for o in range(3)])]))
    p.own(TPS[1], Owned(1, 0), 0)
    p.hold(TPS[1], 1)
    assert p.fence([TPS[0], TPS[1]], 12.5) == [TPS[0]], "only the delivered one is reported delivered"
    assert client.calls[-1] == ("release", [TPS[0], TPS[1]])
    assert p.fenced_at == {TPS[0]: 12.5, TPS[1]: 12.5} and p.owned == {} and p.held == {}
    assert p.queued() == 0 and p.buffered() == (0, 0, False) and p.generation(TPS[0]) is None
    p.check()


def test_records_fetched_across_a_flush_are_dropped_and_the_partition_sought_again() -> None:
    """A reset (or a revoke and a new claim) flushed the queue while the fetch ran: what it brought
    may come from either side of the seek, and the client's position moved past it either way."""
    p, client = make()
    p.own(TPS[0], Owned(1, 0), 0)
    before = p.generations()
    p.own(TPS[0], Owned(2, 40), 40)  # a reset lands while the fetch runs
    client.calls.clear()
    assert p.queue_fetched(before, Fetched([(TPS[0], [Rec(TPS[0], o) for o in range(5)])])) == 0
    assert client.calls == [("seek", (TPS[0], 40))] and p.queued() == 0
    assert p.take_batch(10)[0] == []


def test_records_of_a_partition_not_owned_are_dropped_and_stale_ones_filtered() -> None:
    p, _client = make()
    p.own(TPS[0], Owned(1, 5), 5)
    before = p.generations()
    fetched = Fetched([(TPS[0], [Rec(TPS[0], o) for o in range(3, 8)]), (TPS[1], [Rec(TPS[1], 0)])])
    assert p.queue_fetched(before, fetched) == 3
    records, ends, counts = p.take_batch(10)
    assert [r.offset for r in records] == [5, 6, 7] and ends == {TPS[0]: 8} and counts == {TPS[0]: 3}


def test_a_requeue_goes_back_only_under_the_generation_it_was_taken_in() -> None:
    p, _client = make()
    p.own(TPS[0], Owned(1, 0), 0)
    p.queue_fetched(p.generations(), Fetched([(TPS[0], [Rec(TPS[0], o) for o in range(4)])]))
    generations = {TPS[0]: p.generation(TPS[0]) or 0}
    taken, _, _ = p.take_batch(2)
    p.requeue(taken, generations)
    assert [r.offset for r in p.take_batch(10)[0]] == [0, 1, 2, 3]
    p.queue_fetched(p.generations(), Fetched([(TPS[0], [Rec(TPS[0], o) for o in range(4, 6)])]))
    taken_in = {TPS[0]: p.generation(TPS[0]) or 0}
    taken, _, _ = p.take_batch(1)
    p.own(TPS[0], Owned(2, 100), 100)  # reset meanwhile
    p.requeue(taken, taken_in)
    assert p.take_batch(10)[0] == [], "records from before the reset went back into the queue after it"
    p.check()


def test_a_partition_the_client_cannot_fetch_is_paused_and_noted_or_sought_where_kstore_reads() -> None:
    p, client = make()
    p.own(TPS[0], Owned(1, 10), 10)
    p.own(TPS[1], Owned(1, 20), 20)
    client.calls.clear()
    refused = [Refused(TPS[0], 10), Refused(TPS[1], 7), Refused(TPS[2], NO_POSITION)]
    p.queue_fetched(p.generations(), Fetched([], refused))
    assert p.unfetchable() == {TPS[0]: (10, None)}  # where kstore reads: left for the worker to place
    # Not where kstore reads (a seek overtook the fetch): read from there again.
    assert ("seek", (TPS[1], 20)) in client.calls and ("resume", [TPS[1]]) in client.calls
    # Not owned and with no position: paused at a placeholder until a claim places it.
    assert ("pause", [TPS[2]]) in client.calls and ("seek", (TPS[2], 0)) in client.calls
    p.place(TPS[0], 10)
    assert p.unfetchable() == {}
    p.check()


def test_the_client_moving_past_markers_with_nothing_to_deliver_moves_where_a_batch_ends() -> None:
    """Transaction markers and aborted records: the client's position passes them with nothing
    returned; an emptied queue's batch commits up to that position."""
    p, client = make()
    p.own(TPS[0], Owned(1, 0), 0)
    client.at[TPS[0]] = 5
    p.queue_fetched(p.generations(), Fetched([(TPS[0], [Rec(TPS[0], 0), Rec(TPS[0], 1)])]))
    assert p.take_batch(10)[1] == {TPS[0]: 5}
    client.at[TPS[0]] = 9
    p.queue_fetched(p.generations(), Fetched([]))
    assert p.skipped({TPS[0]: 5}) == {TPS[0]: 9}


def test_fetching_pauses_at_max_buffered_bytes_and_resumes_below_half() -> None:
    p, client = make(max_buffered_bytes=1000)
    p.own(TPS[0], Owned(1, 0), 0)
    client.calls.clear()
    p.queue_fetched(p.generations(), Fetched([(TPS[0], [Rec(TPS[0], o) for o in range(10)])]))
    assert p.buffered() == (10, 1000, True) and client.calls == [("pause", [TPS[0]])]
    p.take_batch(4)
    assert p.buffered()[2], "still above half: fetching stays paused"
    p.take_batch(2)
    assert p.buffered() == (4, 400, False) and client.calls[-1] == ("resume", [TPS[0]])


def test_a_callback_posts_while_the_lock_is_held_elsewhere() -> None:
    """kafka-python's callbacks run on its IO thread while the main thread may hold the lock (and
    wait inside a client call): posting an event must never wait for the lock."""
    p, _client = make()
    posted = threading.Event()
    with p.lock:
        threading.Thread(target=lambda: (p.post("revoked", [TPS[0]]), posted.set()), daemon=True).start()
        assert posted.wait(10), "posting an event waited for the partitions' lock"
    assert p.take_events() == [("revoked", [TPS[0]])] and p.take_events() == []


operations = st.lists(st.one_of(
    st.tuples(st.just("fetch"), st.sampled_from(TPS), st.integers(1, 6), st.booleans()),
    st.tuples(st.just("take"), st.integers(1, 8), st.sampled_from([None, *TPS])),
    st.tuples(st.just("requeue")),
    st.tuples(st.just("own"), st.sampled_from(TPS), st.integers(0, 50)),
    st.tuples(st.just("revoke"), st.sampled_from(TPS)),
    st.tuples(st.just("hold"), st.sampled_from(TPS)),
    st.tuples(st.just("fence"), st.sampled_from(TPS)),
    st.tuples(st.just("assign"), st.sampled_from(TPS)),
), max_size=50)


class Model:
    """What the property test tracks beside the partitions: offsets taken under each claim."""

    def __init__(self) -> None:
        self.p, _client = make(max_buffered_bytes=2000)
        self.in_flight: list[tuple[list[Any], dict[Any, int]]] = []
        #: tp -> (generation, offsets taken under it and not put back)
        self.taken_under: dict[Any, tuple[int, set[int]]] = {}
        self.fetch_from: dict[Any, int] = {}

    def fetch(self, tp: Any, n: int, across_flush: bool) -> None:
        p = self.p
        before = p.generations()
        if across_flush and tp in p.owned:  # a reset lands while the fetch runs
            p.own(tp, Owned(p.owned[tp].epoch + 1, self.fetch_from.get(tp, 0)), self.fetch_from.get(tp, 0))
        start = self.fetch_from.get(tp, 0)
        p.queue_fetched(before, Fetched([(tp, [Rec(tp, o) for o in range(start, start + n)])]))
        self.fetch_from[tp] = start + n

    def take(self, n: int, only: Any) -> None:
        generations = {tp: g for tp in TPS if (g := self.p.generation(tp)) is not None}
        batch, _, _ = self.p.take_batch(n, only)
        for r in batch:
            tp = (r.topic, r.partition)
            generation, seen = self.taken_under.get(tp, (generations[tp], set()))
            if generation != generations[tp]:
                generation, seen = generations[tp], set()
            assert r.offset not in seen, f"{r} taken twice under one claim"
            seen.add(r.offset)
            self.taken_under[tp] = (generation, seen)
        if batch:
            self.in_flight.append((batch, generations))

    def requeue(self) -> None:
        if not self.in_flight:
            return
        batch, generations = self.in_flight.pop()
        self.p.requeue(batch, generations)
        for r in batch:
            tp = (r.topic, r.partition)
            if tp in self.taken_under and self.taken_under[tp][0] == generations.get(tp) == self.p.generation(tp):
                self.taken_under[tp][1].discard(r.offset)

    def own(self, tp: Any, offset: int) -> None:
        self._assigned(tp)
        self.p.own(tp, Owned(1, offset), offset)
        self.fetch_from[tp] = offset

    def revoke(self, tp: Any) -> None:
        self.p.revoke([tp])

    def hold(self, tp: Any) -> None:
        self._assigned(tp)
        self.p.hold(tp, 1)

    def fence(self, tp: Any) -> None:
        if tp in self.p.owned or tp in self.p.held:
            self.p.fence([tp], 1.0)

    def assign(self, tp: Any) -> None:
        if tp not in self.p.owned and tp not in self.p.held:
            self.p.assign([tp])

    def _assigned(self, tp: Any) -> None:
        """A claim starts from pending (or a reset from owned or held): what Kafka no longer assigns here,
        or another worker claimed, is assigned again first."""
        state = self.p.state(tp)
        if state is None or state.status is Status.FENCED:
            self.p.assign([tp])


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_the_invariants_hold_and_no_record_is_delivered_twice_under_one_claim(ops: list[Any]) -> None:
    """Owned <=> queued; one status per partition; the counts add up; and under one claim
    (one generation of a queue) no offset is taken twice unless it was put back."""
    model = Model()
    for kind, *args in ops:
        getattr(model, kind)(*args)
        model.p.check()
    while model.p.take_batch(5)[0]:
        model.p.check()
    records, size, _ = model.p.buffered()
    assert (records, size) == (0, 0)
