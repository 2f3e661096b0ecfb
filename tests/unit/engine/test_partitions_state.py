"""The state machine of one partition in a worker (kstore.engine.partitions): each transition from
each status, allowed or refused, and what the read-only views show. No broker, no database: a
client that records what it is told."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kstore import Settings
from kstore.engine.partitions import Owned, Partitions, Status, TransitionError

from .test_partitions import Client

TP = ("t", 0)
OTHER = ("t", 1)


def make() -> tuple[Partitions, Client]:
    client = Client()
    return Partitions(Settings(), client), client  # type: ignore[arg-type]


def at(status: Status | None) -> tuple[Partitions, Client]:
    """Partitions where TP is in ``status`` (None: unknown), reached by allowed transitions only."""
    p, client = make()
    if status is not None:
        p.assign([TP])
    if status in (Status.OWNED, Status.HELD, Status.FENCED):
        p.own(TP, Owned(1, 10), 10)
    if status is Status.HELD:
        p.hold(TP, 1)
    if status is Status.FENCED:
        p.fence([TP], 5.0)
    state = p.state(TP)
    assert (None if state is None else state.status) is status
    client.calls.clear()
    return p, client


TRANSITIONS: dict[str, Callable[[Partitions], object]] = {
    "assign": lambda p: p.assign([TP]),
    "own": lambda p: p.own(TP, Owned(2, 20), 20),
    "place": lambda p: p.place(TP, 30),
    "hold": lambda p: p.hold(TP, 2),
    "fence": lambda p: p.fence([TP], 7.0),
    "revoke": lambda p: p.revoke([TP]),
}

PEN, OWN, HLD, FEN = Status.PENDING, Status.OWNED, Status.HELD, Status.FENCED
REFUSED = "refused"
GONE = "gone"
#: (from, transition) -> the status after it, GONE (forgotten), or REFUSED.
EXPECTED: dict[tuple[Status | None, str], Status | str] = {
    (None, "assign"): PEN, (PEN, "assign"): PEN, (OWN, "assign"): REFUSED, (HLD, "assign"): REFUSED,
    (FEN, "assign"): PEN,
    (None, "own"): REFUSED, (PEN, "own"): OWN, (OWN, "own"): OWN, (HLD, "own"): OWN, (FEN, "own"): REFUSED,
    (None, "place"): REFUSED, (PEN, "place"): REFUSED, (OWN, "place"): OWN, (HLD, "place"): REFUSED,
    (FEN, "place"): REFUSED,
    (None, "hold"): REFUSED, (PEN, "hold"): HLD, (OWN, "hold"): HLD, (HLD, "hold"): HLD, (FEN, "hold"): REFUSED,
    (None, "fence"): REFUSED, (PEN, "fence"): REFUSED, (OWN, "fence"): FEN, (HLD, "fence"): FEN,
    (FEN, "fence"): REFUSED,
    (None, "revoke"): GONE, (PEN, "revoke"): GONE, (OWN, "revoke"): GONE, (HLD, "revoke"): GONE,
    (FEN, "revoke"): GONE,
}


def snapshot(p: Partitions) -> tuple[Any, ...]:
    state = p.state(TP)
    return (None if state is None else (state.status, state.owned, state.held_epoch, state.fenced_at),
            dict(p.owned), dict(p.held), set(p.pending), dict(p.fenced_at), p.generation(TP), p.buffered())


@pytest.mark.parametrize(("start", "transition"), sorted(EXPECTED, key=str))
def test_each_transition_goes_where_the_state_machine_says_or_is_refused_changing_nothing(
        start: Status | None, transition: str) -> None:
    p, client = at(start)
    expected = EXPECTED[(start, transition)]
    if expected == REFUSED:
        before = snapshot(p)
        with pytest.raises(TransitionError, match=rf"t\[0\]: cannot {transition} a partition that is"):
            TRANSITIONS[transition](p)
        assert snapshot(p) == before and client.calls == [], "a refused transition changed something"
    else:
        TRANSITIONS[transition](p)
        state = p.state(TP)
        assert (GONE if state is None else state.status) == expected
    p.check()


def test_what_each_status_carries_shows_in_its_view() -> None:
    p, _client = at(Status.OWNED)
    assert p.owned == {TP: Owned(1, 10)} and p.generation(TP) is not None and TP not in p.pending
    p.hold(TP, 3)
    assert p.held == {TP: 3} and p.owned == {} and p.generation(TP) is None
    assert p.fence([TP], 9.0) == [], "a held partition was not delivered"
    assert p.fenced_at == {TP: 9.0} and p.held == {} and not p.pending
    p.assign([TP])  # Kafka assigns it again before it was reclaimed: pending, the fence remembered
    assert p.pending == {TP} and p.fenced_at == {TP: 9.0}
    p.revoke([TP])
    assert p.state(TP) is None and p.fenced_at == {}, "a revoked partition is nothing to claim again later"


def test_a_refused_assignment_assigns_none_of_the_partitions_named() -> None:
    p, _client = at(Status.OWNED)
    with pytest.raises(TransitionError):
        p.assign([OTHER, TP])
    assert OTHER not in p.pending and p.state(OTHER) is None


def test_a_refused_fence_fences_none_of_the_partitions_named() -> None:
    p, _client = at(Status.OWNED)
    p.assign([OTHER])
    with pytest.raises(TransitionError):
        p.fence([TP, OTHER], 1.0)
    assert TP in p.owned and p.fenced_at == {} and OTHER in p.pending


def test_reclaim_puts_back_to_pending_only_what_kafka_still_assigns_here() -> None:
    p, _client = make()
    kept, gone, again, revoked = ("t", 0), ("t", 1), ("t", 2), ("t", 3)
    p.assign([kept, gone, again, revoked])
    for tp in (kept, gone, again, revoked):
        p.own(tp, Owned(1, 0), 0)
    p.fence([kept, gone, again, revoked], 1.0)
    p.assign([again])  # assigned again before the reclaim: pending already, its fence remembered
    p.revoke([revoked])  # revoked meanwhile: nothing to reclaim
    assert p.reclaim([kept, gone, again, revoked], assigned={kept, again, revoked}) == [kept, again]
    assert p.pending == {kept, again} and p.fenced_at == {}
    assert p.state(gone) is None and p.state(revoked) is None
    p.check()


def test_owned_partitions_come_in_the_order_they_became_owned() -> None:
    """The round-robin of take_batch starts from the order the partitions were delivered from: a
    partition held and owned again goes last, as a new one would."""
    p, _client = make()
    tps = [("t", i) for i in range(3)]
    p.assign(tps)
    for tp in tps:
        p.own(tp, Owned(1, 0), 0)
    p.hold(tps[0], 1)
    p.own(tps[0], Owned(2, 0), 0)
    p.own(tps[1], Owned(2, 5), 5)  # a reset keeps its place
    assert list(p.owned) == [tps[1], tps[2], tps[0]] and list(p.queues()) == [tps[1], tps[2], tps[0]]


def test_the_views_are_read_only() -> None:
    p, _client = at(Status.PENDING)
    for view, change in ((p.pending, "add"), (p.owned, "pop"), (p.held, "update"), (p.fenced_at, "__setitem__")):
        assert not hasattr(view, change), f"{type(view).__name__} can be changed by {change}"


def test_the_views_can_be_read_without_the_lock_while_the_fetch_thread_changes_the_map() -> None:
    """The main thread reads ``ledger.pending``/``owned`` between batches without the lock while the
    fetch thread assigns and revokes: a read must never fail (as iterating a changing dict would)."""
    p, _client = make()
    tps = [("t", i) for i in range(50)]
    stop = threading.Event()

    def rebalance() -> None:
        while not stop.is_set():
            p.assign(tps)
            p.revoke(tps)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: mid-iteration, if a read iterates
    thread = threading.Thread(target=rebalance, daemon=True)
    thread.start()
    try:
        for _ in range(20_000):
            assert len(p.pending) <= len(tps)
            sorted(p.pending)
            dict(p.owned)
            bool(p.fenced_at)
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
