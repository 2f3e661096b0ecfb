"""Lag samples (migration 0011): a group's lag and stored position over time, in a bounded table.

The web console (:mod:`kstore.console.sampling`) writes one row per group per interval, every
group of one interval in one INSERT, and deletes the rows past the retention in the same
transaction; its charts read a group's rows back. Nothing else reads or writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import BigInteger, Column, DateTime, Engine, Float, MetaData, String, Table, select

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


def write(engine: Engine, table: Table, samples: Sequence[Sample], keep: timedelta) -> None:
    """Add ``samples`` and delete every row older than ``keep`` before the newest of them, in one
    transaction: one statement on PostgreSQL (the DELETE in the INSERT's ``WITH``), two elsewhere."""
    if not samples:
        return
    newest = max(s.at for s in samples)
    insert = table.insert().values([
        {"consumer_group": s.group, "at": s.at, "lag_messages": s.lag_messages, "lag_seconds": s.lag_seconds,
         "stored_offsets": s.stored_offsets, "dead_letters": s.dead_letters} for s in samples
    ])
    expired = table.delete().where(table.c.at < newest - keep)
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(insert.add_cte(expired.cte("expired")))
        else:
            conn.execute(insert)
            conn.execute(expired)


def read(engine: Engine, table: Table, group: str, since: datetime) -> list[Sample]:
    """A group's samples from ``since`` on, oldest first."""
    t = table
    stmt = select(t).where(t.c.consumer_group == group, t.c.at >= since).order_by(t.c.at)
    with engine.connect() as conn:
        return [Sample(r.consumer_group, aware(r.at), r.lag_messages, r.lag_seconds, r.stored_offsets,
                       r.dead_letters) for r in conn.execute(stmt)]
