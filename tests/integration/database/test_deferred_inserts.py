"""The processor's session defers one-row INSERTs and sends them together (kstore.db.session):
what matters to exactly-once, against PostgreSQL (and Kafka). An INSERT that fails when it is
finally sent fails its batch, even under a later message's savepoint, and is pinned to its own
message; psycopg2 sends many rows of a text() INSERT in pages.

The session's contract on SQLite (order, reading your writes, results, savepoints, the ORM, a
failed send) and the SQLAlchemy behaviour it relies on: tests/unit/db/test_session.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg2.extensions
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from kstore import Message, Processor, RetryPolicy, Settings, Worker
from kstore.db.session import BatchSession, batch_session
from kstore.db.store import make_engine
from kstore.testing import run_batch
from tests.integration.failures_and_dead_letters.test_failures import dead_letter_rows
from tests.support.harness import assert_exactly_once, effects, with_driver
from tests.support.processors import effects as effects_table
from tests.unit.db.test_session import (
    DUPLICATE_THEN_SAVEPOINT,
    INSERT_TEXT,
    Base,
    SavepointAfterDuplicate,
    in_session,
    items,
    names,
    seen_offsets,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    """An engine made as the worker makes it, on SQLite or on a fresh PostgreSQL database, with the tables."""
    dsn = f"sqlite:///{tmp_path / 'session.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_dsn")
    eng = make_engine(Settings(dsn=dsn))
    Base.metadata.create_all(eng)
    yield eng
    eng.dispose()


def test_psycopg2_sends_many_rows_of_a_text_statement_in_pages(pg_dsn: str) -> None:
    """Deferred text() INSERTs go together: on psycopg2 as one multi-row statement when the text
    ends with its VALUES row (kstore.db.manyrows), else as kstore's pages of statements (one round
    trip each): never a round trip per row."""
    engine = make_engine(Settings(dsn=with_driver(pg_dsn, "psycopg2")))
    sent: list[int] = []

    @sa.event.listens_for(engine, "connect")
    def count_round_trips(dbapi_conn: Any, _record: Any) -> None:
        if hasattr(dbapi_conn, "cursor_factory"):  # psycopg2: count every query sent
            class Counting(psycopg2.extensions.cursor):  # type: ignore[misc]
                def execute(self, query: Any, vars: Any = None) -> Any:
                    sent.append(1)
                    return super().execute(query, vars)

                def executemany(self, query: Any, vars_list: Any) -> Any:
                    sent.extend(1 for _ in vars_list)
                    return super().executemany(query, vars_list)

            dbapi_conn.cursor_factory = Counting

    Base.metadata.create_all(engine)
    del sent[:]
    with engine.connect() as conn, conn.begin(), batch_session(conn) as session:
        for i in range(1200):
            session.execute(sa.text(INSERT_TEXT), {"name": f"p{i}", "kind": "page"})
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(DISTINCT name) FROM items WHERE kind = 'page'")).scalar() == 1200
    assert len(sent) <= 5, f"{len(sent)} round trips for 1,200 rows"
    engine.dispose()


def test_rolling_back_a_savepoint_keeps_the_inserts_made_before_it(any_engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        session.execute(items.insert(), {"name": "before"})
        session.execute(items.insert(), {"name": "taken"})
        try:
            with session.begin_nested():
                session.execute(items.insert(), {"name": "inside"})
                session.execute(items.insert(), {"name": "taken"})  # duplicate: raises here, not later
            raise AssertionError("the duplicate inside the savepoint should have raised at once")
        except IntegrityError:
            pass
        session.execute(items.insert(), {"name": "after"})

    in_session(any_engine, work)
    assert names(any_engine) == ["before", "taken", "after"]


def test_an_insert_failing_when_a_later_savepoint_sends_it_fails_the_batch(any_engine: sa.Engine) -> None:
    """Not caught as the savepoint's error: on SQLite the batch used to commit without the
    INSERTs deferred after the failing one; on PostgreSQL it failed later, on an aborted transaction."""
    with pytest.raises(IntegrityError, match=r"(?i)unique|duplicate"):
        run_batch(SavepointAfterDuplicate(), DUPLICATE_THEN_SAVEPOINT, any_engine)
    assert names(any_engine) == [] and seen_offsets(any_engine) == [], "nothing of the batch committed"


class UniqueNames(Processor):
    """One deferred INSERT per message into a table with a unique key, one effect row per message."""

    group = "deferred"
    value_format = "str"
    on_error = "dead_letter"
    retry = RetryPolicy(max_attempts=1)

    def handle(self, msg: Message) -> None:
        self.session.execute(effects_table.insert(), {
            "topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset, "value": msg.value})
        self.session.execute(items.insert(), {"name": msg.value})

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.batches = getattr(self, "batches", 0) + 1
        super().handle_batch(msgs)


def test_a_deferred_insert_that_fails_is_pinned_to_its_own_message(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """The duplicate fails only when the batch's INSERTs are sent; the batch is rolled back and
    retried one message per transaction, so exactly the duplicate is dead-lettered."""
    _run_with_one_duplicate(UniqueNames(), pg_dsn, kafka, new_topic, produce)


def _run_with_one_duplicate(processor: Processor, pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """300 names, one of them a duplicate of an earlier one, through a worker on Kafka and PostgreSQL:
    every other message lands once and exactly the duplicate is dead-lettered, with IntegrityError."""
    engine = sa.create_engine(pg_dsn)
    Base.metadata.create_all(engine)
    engine.dispose()
    topic = new_topic(partitions=1)
    first = set(produce(topic, (f"v{i}" for i in range(150))))
    (dup,) = produce(topic, ["v7"])
    rest = set(produce(topic, (f"w{i}" for i in range(149))))
    w = Worker(processor, Settings(dsn=pg_dsn, bootstrap_servers=kafka, topics=(topic,), max_batch_size=100,
                                   session_timeout_ms=6000, heartbeat_interval_ms=1000))
    w.run(idle_timeout=2)
    assert_exactly_once(effects(pg_dsn), first | rest)
    (letter,) = dead_letter_rows(pg_dsn)
    assert (letter.topic, letter.partition_id, letter.offset) == dup
    assert "IntegrityError" in letter.error


class CheckedNames(UniqueNames):
    """UniqueNames, then one more row under a savepoint that catches IntegrityError, as the README shows.

    Its begin_nested() sends the message's own deferred INSERTs: the duplicate's fails there.
    """

    group = "deferred-savepoint"

    def handle(self, msg: Message) -> None:
        super().handle(msg)
        try:
            with self.session.begin_nested():
                self.session.execute(items.insert(), {"name": f"checked-{msg.offset}"})
        except IntegrityError:
            pass


@pytest.mark.timeout(180)
def test_a_deferred_insert_that_fails_when_a_savepoint_sends_it_is_pinned_to_its_own_message(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """The duplicate fails when a begin_nested() sends it, inside the processor's try: the batch
    fails and exactly the duplicate is dead-lettered, with its own error. (That error used to be
    caught as the savepoint's, and the batch failed later on its aborted transaction: the
    dead letter said InFailedSqlTransaction.) The savepoints of the other messages work as before."""
    _run_with_one_duplicate(CheckedNames(), pg_dsn, kafka, new_topic, produce)
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        checked = conn.execute(sa.select(sa.func.count()).where(items.c.name.like("checked-%"))).scalar_one()
    engine.dispose()
    assert checked == 299, "every other message's savepoint wrote its row"


