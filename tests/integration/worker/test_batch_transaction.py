"""The batch's one transaction, from the processor's side: a slow processor, a message whose
transaction the server ends, a processor that ends the transaction itself, and one whose handler
is a coroutine behind a plain decorator. Each through ``kstore worker`` against real Kafka and
PostgreSQL (psycopg2 and psycopg 3): no message's effect lands twice or never, nothing is
retried forever, and what cannot be committed correctly stops the worker with one clear line."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until, with_driver

DRIVERS = ["psycopg2", "psycopg"]


def dsn_for(request: pytest.FixtureRequest, driver: str) -> str:
    """The test database on ``driver``: psycopg2 or psycopg 3 (PostgreSQL), or SQLite."""
    if driver == "sqlite":
        return str(request.getfixturevalue("sqlite_dsn"))
    return with_driver(str(request.getfixturevalue("pg_dsn")), driver)


def dead_lettered(dsn: str, group: str) -> set[tuple[str, int, int]]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text('SELECT topic, partition_id, "offset" FROM kstore_dead_letters '
                                        "WHERE consumer_group = :g"), {"g": group}).all()
    finally:
        engine.dispose()
    return {(r[0], r[1], r[2]) for r in rows}


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_batch_longer_than_the_idle_in_transaction_timeout_lands_exactly_once(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, driver: str) -> None:
    """1,000 messages of 10 ms of Python each (batches of up to 10 s) against a 1 s idle-in-transaction
    timeout. kstore's transaction used to begin before the processor ran, so the server ended the
    session after 1 s of the processor's Python and the same batch was retried forever, nothing
    landing. Now the transaction begins with the batch's first round trip."""
    topic = new_topic(1)
    sent = set(produce(topic, [f"m{i}" for i in range(1000)]))
    w = workers(with_driver(pg_dsn, driver), topic, "slow", processor="contract_processors:Slow",
                env={"KSTORE_TEST_SLEEP_MS": "10", "KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": "1000",
                     "KSTORE_MAX_BATCH_SIZE": "1000"})
    wait_until(lambda: sum(effects(pg_dsn).values()) >= len(sent), 120, what="every message processed")
    wait_until(lambda: stored_offsets(pg_dsn, "slow") == {(topic, 0): len(sent)}, 60, what="offsets at the end")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    assert "server closed the connection" not in w.log
    # The batches were longer than the timeout: the test would not show anything otherwise.
    batches = [line for line in w.log.splitlines() if "committed" in line and "messages:" in line]
    assert any(int(line.split("committed ")[1].split()[0]) > 100 for line in batches), batches


@pytest.mark.parametrize("stall", ["idle", "statement"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_message_that_gets_its_session_cut_every_time_is_narrowed_down_not_retried_forever(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, driver: str, stall: str) -> None:
    """One message stalls its transaction past what the server or kstore allows (idle in
    transaction past the timeout; a statement past the deadline per round trip), so its batch
    fails with a connection error every time, though the database answers in between. That used to
    be taken for an outage and the batch retried at the same size forever. Now the batch is narrowed
    down, the message is dead-lettered by policy, and every other message lands once."""
    topic = new_topic(1)
    before = set(produce(topic, [f"a{i}" for i in range(20)]))
    (bad,) = produce(topic, ["stall"])
    after = set(produce(topic, [f"b{i}" for i in range(20)]))
    env = {"KSTORE_TEST_STALL_VALUE": "stall", "KSTORE_TEST_STALL": stall, "KSTORE_MAX_BATCH_SIZE": "16"}
    if stall == "idle":
        env |= {"KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": "500", "KSTORE_TEST_STALL_S": "2"}
    else:
        env |= {"KSTORE_DB_TIMEOUT_S": "1", "KSTORE_TEST_STALL_S": "3"}
    w = workers(with_driver(pg_dsn, driver), topic, "stall", processor="contract_processors:Slow", env=env,
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: dead_lettered(pg_dsn, "stall"), 150, what="the stalling message dead-lettered")
    wait_until(lambda: stored_offsets(pg_dsn, "stall") == {(topic, 0): 41}, 60, what="offsets past everything")
    assert w.terminate() == 0
    assert dead_lettered(pg_dsn, "stall") == {bad}
    assert_exactly_once(effects(pg_dsn), before | after)
    assert "though the database answered in between" in w.log


@pytest.mark.parametrize("processor", ["WrappedCoroutine", "WrappedCoroutineHook"])
def test_a_coroutine_behind_a_plain_decorator_stops_the_worker_before_an_offset_moves_without_it(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, processor: str) -> None:
    """An `async def handle` behind a sync decorator passes the start-up check and returns a coroutine
    per message, which used to be dropped: every offset committed, no row written. Now the worker
    stops at the first batch, with one line saying why, and nothing of that batch commits. (An async
    hook run after the commit stops it too: its batch stays committed, with its effects.)"""
    topic = new_topic(1)
    produce(topic, [f"m{i}" for i in range(50)])
    w = workers(pg_dsn, topic, "coro", processor=f"contract_processors:{processor}",
                args=["--on-error", "dead_letter"])
    assert w.wait(120) == 1
    assert "returned coroutine" in w.log and "never ran" in w.log
    assert "was never awaited" not in w.log
    if processor == "WrappedCoroutine":
        assert not effects(pg_dsn)
        assert stored_offsets(pg_dsn, "coro") in ({}, {(topic, 0): 0}, {(topic, 0): None})
        assert not dead_lettered(pg_dsn, "coro")
    else:
        offsets = stored_offsets(pg_dsn, "coro")[(topic, 0)]
        assert offsets and sum(effects(pg_dsn).values()) == offsets  # what committed has its effects


@pytest.mark.parametrize("call", ["dbapi-commit", "dbapi-rollback"])
@pytest.mark.parametrize("driver", [*DRIVERS, "sqlite"])
def test_a_processors_own_dbapi_commit_or_rollback_fails_its_batch_and_loses_nothing(
        request: pytest.FixtureRequest, new_topic: Any, produce: Any, workers: Any, driver: str, call: str) -> None:
    """A processor (or a library it calls) that commits or rolls back the DBAPI connection under the
    session, and swallows any error: on psycopg 3 a rollback lost the earlier messages' effects while
    their offsets committed, on psycopg2 it was silently a no-op. Now the call is refused and the
    batch fails: the message is dead-lettered by policy, every other message lands once."""
    topic = new_topic(1)
    good = set(produce(topic, [f"ok{i}" for i in range(30)]))
    (bad,) = produce(topic, [call])
    good |= set(produce(topic, [f"after{i}" for i in range(30)]))
    dsn = dsn_for(request, driver)
    w = workers(dsn, topic, "ends", processor="contract_processors:EndsTransaction",
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: dead_lettered(dsn, "ends"), 90, what="the message dead-lettered")
    wait_until(lambda: stored_offsets(dsn, "ends") == {(topic, 0): 61}, 60, what="offsets past everything")
    assert w.terminate() == 0
    assert dead_lettered(dsn, "ends") == {bad}
    assert_exactly_once(effects(dsn), good)
    assert f"{call.split('-')[1]}() on the batch's database connection is refused" in w.log


@pytest.mark.parametrize("driver", [*DRIVERS, "sqlite"])
def test_a_processor_that_commits_through_sql_stops_the_worker_before_its_offsets_commit(
        request: pytest.FixtureRequest, new_topic: Any, produce: Any, workers: Any, driver: str) -> None:
    """COMMIT sent through SQL mid-batch lands what the batch wrote so far without its offsets, and
    later statements run in another transaction (or none). kstore cannot undo it, nor retry the batch
    without applying that part twice: it commits none of the batch's offsets and stops."""
    topic = new_topic(1)
    produce(topic, [f"ok{i}" for i in range(10)])
    (bad,) = produce(topic, ["sql-commit"])
    produce(topic, [f"after{i}" for i in range(10)])
    dsn = dsn_for(request, driver)
    w = workers(dsn, topic, "sqlcommit", processor="contract_processors:EndsTransaction",
                args=["--on-error", "dead_letter"])
    assert w.wait(120) == 1
    assert "ended the batch's transaction itself" in w.log
    stored = stored_offsets(dsn, "sqlcommit").get((topic, 0))
    assert stored is None or stored <= bad[2]  # the batch holding it never committed its offsets
    assert not dead_lettered(dsn, "sqlcommit")


@pytest.mark.parametrize("driver", [*DRIVERS, "sqlite"])
def test_a_batch_whose_first_round_trip_is_an_executemany_commits(
        request: pytest.FixtureRequest, new_topic: Any, produce: Any, workers: Any, driver: str) -> None:
    """An upsert of the batch's rows as its first statement (the demo's page-view counter): psycopg 3
    sends it in pipeline mode, which it enters while the server is still outside the transaction, and
    that was taken for the processor ending the transaction itself (the worker stopped at its first
    batch). Every message lands once; a COMMIT through SQL after such an executemany still stops it."""
    topic = new_topic(1)
    sent = set(produce(topic, [f"m{i}" for i in range(500)]))
    dsn = dsn_for(request, driver)
    w = workers(dsn, topic, "upserts", processor="contract_processors:UpsertsFirst",
                args=["--max-batch-size", "50"])
    wait_until(lambda: stored_offsets(dsn, "upserts") == {(topic, 0): 500}, 90, what="offsets at the end")
    (bad,) = produce(topic, ["sql-commit"])
    assert w.wait(120) == 1
    assert "ended the batch's transaction itself" in w.log
    assert stored_offsets(dsn, "upserts") == {(topic, 0): 500}
    landed = effects(dsn)
    del landed[bad]  # committed by the processor's own COMMIT, without its offset
    assert_exactly_once(landed, sent)


@pytest.mark.parametrize("driver", [*DRIVERS, "sqlite"])
def test_batches_that_write_nothing_commit_their_offsets(
        request: pytest.FixtureRequest, new_topic: Any, produce: Any, workers: Any, driver: str) -> None:
    """A batch that never touches the database (its BEGIN is then sent with its commit) and one that
    only reads commit their offsets like any other, and the worker carries on."""
    topic = new_topic(2)
    produce(topic, [f"m{i}" for i in range(300)], partition=0)
    dsn = dsn_for(request, driver)
    w = workers(dsn, topic, "reads", processor="contract_processors:ReadsOnly")
    wait_until(lambda: stored_offsets(dsn, "reads").get((topic, 0)) == 300, 90, what="partition 0's offsets")
    produce(topic, ["lone"], partition=1)  # alone at offset 0: a batch that makes no round trip of its own
    wait_until(lambda: stored_offsets(dsn, "reads") == {(topic, 0): 300, (topic, 1): 1}, 60, what="every offset")
    assert w.terminate() == 0
    assert "ended the batch's transaction" not in w.log
