"""kstore's workaround for a kafka-python 3 rebalance that stalls for good
(kstore.kafka.kafkapython.consumer.StalledRebalance):
a scripted coordinator and clock, each state the check must tell apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kafka.structs import MemberState

from kstore.kafka.kafkapython.consumer import STALLED_REBALANCE_S, StalledRebalance


@dataclass
class Task:
    is_done: bool


@dataclass
class Coordinator:
    """The parts of kafka-python's ConsumerCoordinator the check reads, and its rejoin request."""

    state: Any = MemberState.REBALANCING
    _join_task: Task | None = field(default_factory=lambda: Task(is_done=True))
    rejoin_needed: bool = False
    requested: int = 0

    def need_rejoin(self) -> bool:
        return self.rejoin_needed

    def request_rejoin(self) -> None:
        self.requested += 1
        self.rejoin_needed = True


@dataclass
class Consumer:
    _coordinator: Coordinator


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def checker(coordinator: Coordinator) -> tuple[StalledRebalance, Clock]:
    clock = Clock()
    return StalledRebalance(Consumer(coordinator), clock), clock


def test_a_rebalance_stalled_with_nothing_in_flight_is_asked_to_rejoin_once() -> None:
    """The stall kafka-python gets into: REBALANCING, its join task done, and need_rejoin() False."""
    coordinator = Coordinator()
    stall, clock = checker(coordinator)
    assert not stall.check()  # seen once: the start of the grace period
    clock.now += STALLED_REBALANCE_S - 0.1
    assert not stall.check() and coordinator.requested == 0
    clock.now += 0.2
    assert stall.check() and coordinator.requested == 1
    clock.now += 10 * STALLED_REBALANCE_S  # now need_rejoin() is True: the next poll joins; no second request
    assert not stall.check() and coordinator.requested == 1
    assert stall.rejoins == 1


def test_a_rebalance_in_progress_is_left_alone() -> None:
    for busy in (Coordinator(_join_task=Task(is_done=False)),  # JoinGroup/SyncGroup still in flight
                 Coordinator(rejoin_needed=True),  # the next poll joins by itself
                 Coordinator(state=MemberState.STABLE),  # joined
                 Coordinator(state=MemberState.UNJOINED)):
        stall, clock = checker(busy)
        for _ in range(5):
            assert not stall.check()
            clock.now += STALLED_REBALANCE_S
        assert busy.requested == 0, busy


def test_the_grace_period_starts_again_when_the_stall_breaks_off() -> None:
    coordinator = Coordinator()
    stall, clock = checker(coordinator)
    stall.check()
    clock.now += STALLED_REBALANCE_S - 0.5
    coordinator.state = MemberState.STABLE
    assert not stall.check()
    coordinator.state = MemberState.REBALANCING
    clock.now += 1.0
    assert not stall.check()  # a new stall: its own grace period
    clock.now += STALLED_REBALANCE_S
    assert stall.check() and coordinator.requested == 1


def test_a_client_without_that_private_state_is_never_touched() -> None:
    """Another kafka-python version, or a stand-in consumer (the simulation's): nothing is done."""
    stall = StalledRebalance(object(), Clock())
    assert not stall.check() and not stall.check()
