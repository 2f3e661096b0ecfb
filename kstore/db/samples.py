"""Lag samples (migrations 0011 and 0013): a group's lag and stored position over time, and each
of its partitions', in bounded tables.

The web console (:mod:`kstore.console.sampling`) writes one row per group and one per partition
per interval, every group of one interval in one statement on PostgreSQL, which also deletes the
rows past their retention; its charts read a group's or a partition's rows back. Nothing else reads
or writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import BigInteger, Column, DateTime, Engine, Float, Integer, MetaData, String, Table, select

from .writes import aware


@dataclass(frozen=True)
class Sample:
    """One group at one moment."""

    group: str
    at: datetime
    #: Messages behind, summed over the group's partitions.
    lag_messages: int
    #: The oldest waiting message's age (the largest of its partitions'), None when unknown.
    lag_seconds: float | None
    #: The sum of the group's stored next offsets: what it has processed, so its rise is the throughput.
    stored_offsets: int
    #: Dead letters waiting.
    dead_letters: int
    #: Each partition's lag and stored offset at the same moment.
    partitions: tuple[PartitionSample, ...] = ()


@dataclass(frozen=True)
class PartitionSample:
    """One partition of a group at one moment (the moment of its group's :class:`Sample`)."""

    topic: str
    partition: int
    lag_messages: int
    #: The stored next offset (None: the partition has no stored offset): its rise is the throughput.
    stored_offset: int | None


def build_partition_table(prefix: str = "kstore_", schema: str | None = None) -> Table:
    return Table(
        f"{prefix}lag_partition_samples",
        MetaData(schema=schema),
        Column("consumer_group", String(255), primary_key=True),
        Column("topic", String(255), primary_key=True),
        Column("partition_id", Integer, primary_key=True, autoincrement=False),
        Column("at", DateTime(timezone=True), primary_key=True),
        Column("lag_messages", BigInteger, nullable=False),
        Column("stored_offset", BigInteger, nullable=True),
    )


def build_table(prefix: str = "kstore_", schema: str | None = None) -> Table:
    return Table(
        f"{prefix}lag_samples",
        MetaData(schema=schema),
        Column("consumer_group", String(255), primary_key=True),
        Column("at", DateTime(timezone=True), primary_key=True),
        Column("lag_messages", BigInteger, nullable=False),
        Column("lag_seconds", Float, nullable=True),
        Column("stored_offsets", BigInteger, nullable=False),
        Column("dead_letters", BigInteger, nullable=False),
    )


def write(engine: Engine, table: Table, partition_table: Table, samples: Sequence[Sample], keep: timedelta,
          keep_partitions: timedelta) -> None:
    """Add ``samples`` (with their partitions' rows) and delete every row older than ``keep``
    (``keep_partitions`` for the partitions' rows) before the newest of them, in one transaction:
    one statement on PostgreSQL (the partitions' INSERT and both DELETEs in the group INSERT's
    ``WITH``), four elsewhere."""
    if not samples:
        return
    newest = max(s.at for s in samples)
    insert = table.insert().values([
        {"consumer_group": s.group, "at": s.at, "lag_messages": s.lag_messages, "lag_seconds": s.lag_seconds,
         "stored_offsets": s.stored_offsets, "dead_letters": s.dead_letters} for s in samples
    ])
    parts = [{"consumer_group": s.group, "topic": p.topic, "partition_id": p.partition, "at": s.at,
              "lag_messages": p.lag_messages, "stored_offset": p.stored_offset} for s in samples for p in s.partitions]
    more = [partition_table.insert().values(parts)] if parts else []
    expired = [table.delete().where(table.c.at < newest - keep),
               partition_table.delete().where(partition_table.c.at < newest - keep_partitions)]
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(insert.add_cte(*(other.cte(f"also_{n}") for n, other in enumerate([*more, *expired]))))
        else:
            for statement in [insert, *more, *expired]:
                conn.execute(statement)


def read_partition(engine: Engine, table: Table, group: str, topic: str, partition: int,
                   since: datetime) -> list[tuple[datetime, int, int | None]]:
    """A partition's samples from ``since`` on, oldest first: ``(at, lag, stored offset)``."""
    t = table
    stmt = (select(t.c.at, t.c.lag_messages, t.c.stored_offset)
            .where(t.c.consumer_group == group, t.c.topic == topic, t.c.partition_id == partition, t.c.at >= since)
            .order_by(t.c.at))
    with engine.connect() as conn:
        return [(aware(r.at), int(r.lag_messages), r.stored_offset) for r in conn.execute(stmt)]


def read(engine: Engine, table: Table, group: str, since: datetime) -> list[Sample]:
    """A group's samples from ``since`` on, oldest first."""
    t = table
    stmt = select(t).where(t.c.consumer_group == group, t.c.at >= since).order_by(t.c.at)
    with engine.connect() as conn:
        return [Sample(r.consumer_group, aware(r.at), r.lag_messages, r.lag_seconds, r.stored_offsets,
                       r.dead_letters) for r in conn.execute(stmt)]
