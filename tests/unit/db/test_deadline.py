"""The deadline watchdog (kstore.db.deadline): what it remembers of the round trips it guards."""

from __future__ import annotations

from kstore.db.deadline import Watchdog


def test_the_watchdog_forgets_round_trips_that_answered() -> None:
    """Every disarmed round trip used to stay in the heap until its deadline (300,000 calls: 299,309
    entries, 33 MiB, with the default 30 s). Now the heap stays about as large as what is armed."""
    dog = Watchdog()
    for _ in range(100_000):
        with dog.guard(-1, 30.0):
            pass
    assert len(dog._heap) <= 100
    with dog.guard(-1, 30.0), dog.guard(-1, 30.0):
        assert len(dog._armed) == 2
    assert dog.cuts == 0
