"""Guards of exactly once on their own, against real Kafka and a real PostgreSQL, on both drivers.

The simulation (tests/sim/test_guards.py) runs kstore on SQLite. Here psycopg2 sends the offsets'
compare-and-set and its COMMIT as one message (kstore/db/store.py), psycopg 3 as two; and another
worker's claim can land while a batch's transaction is open, after the revoke check (on SQLite the
batch's transaction locks the whole database). A guard is switched off in this process
(tests/sim/guards.py), where the worker runs on a thread.

- The compare-and-set and the read back: a batch's COMMIT is cut after the server committed it
  (tests/faultproxy.py): each guard alone keeps the batch from landing twice; without both it does.
- The epoch fence: another worker claims the partition after the batch passed its revoke check:
  only the epoch fence stops the batch's commit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from kstore import Settings, Worker
from kstore.db.store import Store, make_engine
from kstore.engine.ownership import Ledger
from tests.conftest import KAFKA_CLIENT
from tests.sim.guards import switched_off
from tests.support.faultproxy import FaultProxy
from tests.support.harness import assert_exactly_once, effects, wait_until, with_driver
from tests.support.processors import Recorder

pytestmark = pytest.mark.integration

DRIVERS = ["psycopg2", "psycopg"]
#: What the worker logs when the read back said "did not land", and when the rows then showed that it had.
RERUN = "did not land: processing it again"
CAUGHT = "differs from this worker's"


@pytest.fixture
def pg_proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    url = make_url(pg_dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy


def _cut_one_batch_commit(pg_dsn: str, proxy: FaultProxy, kafka: str, new_topic: Any, produce: Any,
                          driver: str, off: frozenset[str], done: Any) -> set[tuple[str, int, int]]:
    """A worker processes a first message, then the COMMIT of a batch of 20 lands and its answer is lost;
    returns the messages sent, once ``done(effects)`` holds."""
    topic = new_topic(1)
    expected = set(produce(topic, ["a0"]))
    worker = Worker(Recorder(), Settings(dsn=with_driver(proxy.dsn_through(pg_dsn), driver), bootstrap_servers=kafka,
                                         group="guards", topics=(topic,), max_batch_size=50, relay=False,
                                         kafka_client=KAFKA_CLIENT))
    runner = threading.Thread(target=worker.run, daemon=True)
    with switched_off(off):
        runner.start()
        try:
            # Armed once the worker is connected and has committed a batch (see tests/faultproxy.py).
            wait_until(lambda: effects(pg_dsn), 60, what="the first message")
            proxy.cut_after_commit(touching="effects")
            expected |= set(produce(topic, [f"b{i}" for i in range(20)]))
            wait_until(lambda: proxy.commits_cut >= 1, 60, what="a batch's COMMIT cut")
            wait_until(lambda: done(effects(pg_dsn), expected), 60, what="the batch settled")
        finally:
            worker.request_stop()
            runner.join(60)
    assert not runner.is_alive()
    return expected


def _all_once(counts: Any, expected: set[tuple[str, int, int]]) -> bool:
    return set(counts) >= expected


def _doubled(counts: Any) -> bool:
    return any(n > 1 for n in counts.values())


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_position_check_alone_stops_a_landed_batch_from_landing_again(
        pg_dsn: str, pg_proxy: FaultProxy, kafka: str, new_topic: Any, produce: Any, driver: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kstore")

    def settled(counts: Any, expected: set[tuple[str, int, int]]) -> bool:
        return _all_once(counts, expected) and (CAUGHT in caplog.text or _doubled(counts))

    expected = _cut_one_batch_commit(pg_dsn, pg_proxy, kafka, new_topic, produce, driver,
                                     frozenset({"read_back"}), settled)
    assert RERUN in caplog.text, "the batch was not run again: the position check was never needed"
    assert_exactly_once(effects(pg_dsn), expected)
    assert CAUGHT in caplog.text  # the re-run's compare-and-set found the rows at the batch's end


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_read_back_alone_stops_a_landed_batch_from_landing_again(
        pg_dsn: str, pg_proxy: FaultProxy, kafka: str, new_topic: Any, produce: Any, driver: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kstore")

    def settled(counts: Any, expected: set[tuple[str, int, int]]) -> bool:
        return _all_once(counts, expected) and ("but landed: not processing it again" in caplog.text
                                                or _doubled(counts))

    expected = _cut_one_batch_commit(pg_dsn, pg_proxy, kafka, new_topic, produce, driver,
                                     frozenset({"position"}), settled)
    assert RERUN not in caplog.text
    assert_exactly_once(effects(pg_dsn), expected)


@pytest.mark.parametrize("driver", DRIVERS)
def test_without_position_check_and_read_back_a_landed_batch_lands_twice(
        pg_dsn: str, pg_proxy: FaultProxy, kafka: str, new_topic: Any, produce: Any, driver: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The scenario above can fail: with neither guard, the batch's effects land a second time."""
    caplog.set_level(logging.INFO, logger="kstore")

    def doubled(counts: Any, expected: set[tuple[str, int, int]]) -> bool:
        return _all_once(counts, expected) and _doubled(counts)

    _cut_one_batch_commit(pg_dsn, pg_proxy, kafka, new_topic, produce, driver,
                          frozenset({"position", "read_back"}), doubled)
    assert RERUN in caplog.text


# -- the epoch fence: a claim that comes after the revoke check ----------------------------------

def _claim_after_the_revoke_check(pg_dsn: str, kafka: str, new_topic: Any, produce: Any, driver: str,
                                  off: frozenset[str], caplog: pytest.LogCaptureFixture) -> tuple[Any, set[Any]]:
    """A worker processes a first message; then, while its next batch's transaction is open and
    its revoke check has passed, another worker claims the partition (its session timed out, say,
    and Kafka gave the partition away: this worker has not heard yet). Returns the partition's row
    (next_offset, epoch, owner) once this worker's commit was refused or landed, and the first
    message's effect (the batch's messages are the rest)."""
    caplog.set_level(logging.INFO, logger="kstore")
    topic = new_topic(1)
    first = set(produce(topic, ["a0"]))
    settings = Settings(dsn=with_driver(pg_dsn, driver), bootstrap_servers=kafka, group="zombie", topics=(topic,),
                        max_batch_size=50, relay=False, kafka_client=KAFKA_CLIENT)
    other = Store(make_engine(Settings(dsn=pg_dsn)), Settings(dsn=pg_dsn))
    armed, claimed = threading.Event(), threading.Event()
    check = Ledger.dropped

    def dropped(self: Ledger, positions: Any) -> set[Any]:
        gone = check(self, positions)
        if armed.is_set() and positions and not claimed.is_set():
            with other.claiming("zombie", list(positions), "another-worker"):
                pass
            claimed.set()
        return gone

    worker = Worker(Recorder(), settings)
    runner = threading.Thread(target=worker.run, daemon=True)
    try:
        with switched_off(off), mock.patch.object(Ledger, "dropped", dropped):
            runner.start()
            try:
                wait_until(lambda: effects(pg_dsn), 60, what="the first message")
                armed.set()
                produce(topic, [f"b{i}" for i in range(20)])
                wait_until(claimed.is_set, 60, what="a claim after the revoke check")
                wait_until(lambda: "another worker claimed" in caplog.text or len(effects(pg_dsn)) > 1, 60,
                           what="the batch's commit refused or landed")
            finally:
                worker.request_stop()
                runner.join(60)
        assert not runner.is_alive()
        with other.engine.connect() as conn:
            row = conn.execute(sa.text("SELECT next_offset, epoch, owner FROM kstore_offsets "
                                       "WHERE consumer_group = 'zombie'")).one()
    finally:
        other.engine.dispose()
    return row, first


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_epoch_fence_stops_a_batch_whose_partition_was_claimed_after_its_revoke_check(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, driver: str, caplog: pytest.LogCaptureFixture) -> None:
    row, first = _claim_after_the_revoke_check(pg_dsn, kafka, new_topic, produce, driver, frozenset(), caplog)
    assert row.owner == "another-worker" and row.next_offset == 1, row  # the batch (offsets 1..20) did not commit
    assert_exactly_once(effects(pg_dsn), first)


@pytest.mark.parametrize("driver", DRIVERS)
def test_without_the_epoch_fence_a_batch_whose_partition_was_claimed_after_its_revoke_check_commits(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, driver: str, caplog: pytest.LogCaptureFixture) -> None:
    """The scenario above can fail, and the revoke check (on) cannot help: the worker commits
    into a row another worker holds."""
    row, _first = _claim_after_the_revoke_check(pg_dsn, kafka, new_topic, produce, driver, frozenset({"epoch"}),
                                                caplog)
    assert row.owner == "another-worker" and row.next_offset > 1, row
