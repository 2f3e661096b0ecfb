"""Commits in doubt and silent databases, against real Kafka and a real PostgreSQL
behind the fault-injecting proxy (tests/faultproxy.py).

A COMMIT whose answer is lost may have landed. Each test here cuts the
connection at exactly that byte (the server has committed, the worker never
hears it) or makes the database go silent, and checks that every effect lands
exactly once and that the worker says what happened.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from .faultproxy import FaultProxy
from .harness import assert_exactly_once, effects, stored_offsets, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def pg_proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    url = make_url(pg_dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy


def dead_letters(dsn: str) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text('SELECT topic, partition_id, "offset" FROM kstore_dead_letters')))
    finally:
        engine.dispose()


def test_batch_commits_in_doubt_land_exactly_once(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                  produce: Any, workers: Any) -> None:
    """The defect the fault check found: 6 cut COMMITs made 800 duplicate effects on the old code."""
    topic = new_topic(4)
    expected = set(produce(topic, [f"m{i}" for i in range(3000)]))
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "indoubt",
                env={"KSTORE_MAX_BATCH_SIZE": "100", "KSTORE_TEST_BATCH_SLEEP": "0.01"})
    w.wait_for_log(r"claimed ")
    for n in range(1, 7):
        pg_proxy.cut_after_commit()
        wait_until(lambda n=n: pg_proxy.commits_cut >= n, 60, what=f"commit cut {n}")
    wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 90, what="every message processed")
    time.sleep(1)  # a duplicate would come right after a resolution
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), expected)
    assert w.log.count("lost its answer") >= 6, w.log[-3000:]
    assert "but landed: not processing it again" in w.log
    assert sum(stored_offsets(pg_dsn, "indoubt").values()) == len(expected)


def test_dead_letter_commit_in_doubt_writes_one_dead_letter(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                            produce: Any, workers: Any) -> None:
    """The dead letter's COMMIT loses its answer: still one dead letter, and the offset moves past it once."""
    topic = new_topic(1)
    before = set(produce(topic, [f"ok{i}" for i in range(50)]))
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "indoubt-dl", env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(before), 60, what="the first messages")
    # Failed attempts roll back; the next COMMIT after the poison arrives is its dead letter's.
    pg_proxy.cut_after_commit()
    (poison,) = produce(topic, ["poison"])
    wait_until(lambda: pg_proxy.commits_cut >= 1, 60, what="the dead letter's commit cut")
    after = set(produce(topic, [f"late{i}" for i in range(20)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(before) + len(after), 60, what="the messages after the poison")
    assert w.terminate() == 0
    assert [tuple(r) for r in dead_letters(pg_dsn)] == [poison]
    assert_exactly_once(effects(pg_dsn), before | after)
    assert stored_offsets(pg_dsn, "indoubt-dl") == {(topic, 0): poison[2] + 21}
    assert "the COMMIT of a dead letter" in w.log


def test_claim_in_doubt_delivers_nothing_until_a_claim_is_known(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                                produce: Any, workers: Any) -> None:
    """The first COMMIT of a worker is its claim (and where each partition starts): cut it. Nothing
    may be delivered under that claim; the worker claims again and everything lands once."""
    topic = new_topic(2)
    expected = set(produce(topic, [f"c{i}" for i in range(200)]))
    pg_proxy.cut_after_commit()
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "indoubt-claim")
    wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 60, what="every message processed")
    assert w.terminate() == 0
    assert pg_proxy.commits_cut == 1
    assert_exactly_once(effects(pg_dsn), expected)
    log = w.log
    failed_claim = log.index("could not claim")
    assert not re.search(r"committed \d+ messages", log[:failed_claim]), "a batch ran under an unanswered claim"
    assert log.index("claimed ") > failed_claim


def test_a_silent_database_is_detected_within_the_deadline(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                           produce: Any, workers: Any) -> None:
    """A blackhole (nothing forwarded, nothing closed) must not hang the worker: each round trip
    has KSTORE_DB_TIMEOUT_S, after which the connection is cut and the work resolved."""
    topic = new_topic(2)
    first = set(produce(topic, [f"a{i}" for i in range(100)]))
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "silent", env={"KSTORE_DB_TIMEOUT_S": "3"})
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the first messages")
    pg_proxy.blackhole_for(12)
    started = time.monotonic()
    second = set(produce(topic, [f"b{i}" for i in range(100)]))
    w.wait_for_log(r"database round trip got no answer within its deadline", timeout=30)
    detected = time.monotonic() - started
    assert detected < 10, f"detected after {detected:.1f}s with a 3s deadline"
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | second), 60, what="processing after the partition")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | second)
