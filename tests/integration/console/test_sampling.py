"""The console's lag sampling against real Kafka and PostgreSQL: what it reads of every group and
partition, and that one round asks the database twice however many groups there are (one read, one
write)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.console.state import Console
from kstore.db import deadletters
from kstore.db.writes import now

pytestmark = pytest.mark.integration


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """Every statement any engine sends while the test runs."""
    sent: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", note)
    try:
        yield sent
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", note)


def _letter(group: str, topic: str, partition: int, offset: int, status: str = deadletters.DEAD) -> dict[str, Any]:
    return {"consumer_group": group, "topic": topic, "partition_id": partition, "offset": offset, "key": None,
            "value": b"v", "headers": "[]", "error": "ValueError: bad", "traceback": "...", "attempts": 1,
            "first_failure_at": now(), "last_failure_at": now(), "status": status}


def test_one_round_of_sampling_reads_every_group_in_one_statement_and_writes_them_in_one(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
        statements: list[str]) -> None:
    topics = [new_topic(partitions=3) for _ in range(4)]
    groups = [f"sampled-{n}" for n in range(4)]
    for n, topic in enumerate(topics):
        for p in range(3):
            produce(topic, [b"x"] * (10 + n), partition=p)
    console = Console(Settings(dsn=pg_dsn, bootstrap_servers=kafka, console_read_only=True,
                               console_sample_interval_s=0), {})
    try:
        with console.engine.begin() as conn:
            conn.execute(console.store.offsets.insert(), [
                {"consumer_group": g, "topic": t, "partition_id": p, "next_offset": p, "epoch": 1, "updated_at": now()}
                for g, t in zip(groups, topics, strict=True) for p in range(3)])
            conn.execute(deadletters.build_table().insert(), [
                _letter(groups[0], topics[0], 1, 3), _letter(groups[0], topics[0], 1, 4),
                _letter(groups[0], topics[0], 2, 5, status=deadletters.REPLAYED),
                _letter(groups[2], topics[2], 0, 7), _letter("letters-only", topics[3], 0, 1)])
        console.sampler.sample_once()  # the first round also checks the migrations and reads each record's age
        statements.clear()

        taken = console.sampler.sample_once()

        assert len(statements) == 2, statements
        assert statements[1].lstrip().upper().startswith("WITH")  # the retention's DELETE rides in the INSERT
        assert [s.group for s in taken] == groups  # "letters-only" has no stored offset: not a group
        # Partition p of group n: 10 + n records, stored offset p: lag 10 + n - p, summed over 3 partitions.
        assert [s.lag_messages for s in taken] == [3 * (10 + n) - 3 for n in range(4)]
        assert [s.stored_offsets for s in taken] == [3] * 4
        assert [s.dead_letters for s in taken] == [2, 0, 1, 0]  # waiting only: the replayed one is not
        history = console.sampler.history(groups[2], timedelta(hours=1))
        assert [(s.lag_messages, s.dead_letters) for s in history] == [(33, 1), (33, 1)]
        # And each partition's, written in the same statement: partition 1 of group 2 is 12 - 1 behind.
        assert [(s.lag_messages, s.stored_offsets) for s in console.sampler.partition_history(
            groups[2], topics[2], 1)] == [(11, 1), (11, 1)]
    finally:
        console.close()
