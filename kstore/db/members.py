"""The registry of a group's workers that write to this database (migration 0009).

Each worker keeps one row while it runs: its name, its Kafka member id once it has joined, when it
was last seen and whether it has claimed a partition of the group. The worker compares the group's
live members (Kafka's describe group) with these rows: a member no row names writes to another
database (see :mod:`kstore.engine.onedatabase`); ``kstore offsets show`` names as owners only
members that a row names.

Every write is a short transaction of its own, never inside a batch. A row not seen for
:meth:`GroupMembers.stale_after_s` is ignored (its worker died without deleting it).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Column, DateTime, Engine, MetaData, String, Table, delete, insert, select, update

from .writes import WRITES, aware, now

#: A registry row counts as live for at least this long after it was last seen.
MIN_STALE_AFTER_S = 60.0


@dataclass(frozen=True)
class Registered:
    """A live worker of the group, as its registry row says."""

    member: str
    kafka_member_id: str | None
    claimed: bool


def members_table(prefix: str, schema: str | None) -> Table:
    return Table(
        f"{prefix}group_members", MetaData(schema=schema),
        Column("consumer_group", String(255), primary_key=True),
        Column("member", String(255), primary_key=True),
        Column("kafka_member_id", String(255), nullable=True),
        Column("registered_at", DateTime(timezone=True), nullable=False),
        Column("seen_at", DateTime(timezone=True), nullable=False),
        Column("claimed_at", DateTime(timezone=True), nullable=True),
    )


def stale_after_s(session_timeout_ms: int) -> float:
    """How long a row counts as live after it was last seen: three session timeouts, at least a minute
    (a worker refreshes its row every few seconds while it runs)."""
    return max(3 * session_timeout_ms / 1000, MIN_STALE_AFTER_S)


class GroupMembers:
    """One worker's view of its group's registry in one database."""

    def __init__(self, engine: Engine, group: str, prefix: str = "kstore_", schema: str | None = None) -> None:
        self.engine = engine
        self.group = group
        self.table = members_table(prefix, schema)

    def register(self, member: str) -> None:
        """Add ``member``'s row (or renew it: a name is unique per process, so a row under it is its own)."""
        t, at = self.table, now()
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            conn.execute(delete(t).where(t.c.consumer_group == self.group, t.c.member == member))
            conn.execute(insert(t).values(consumer_group=self.group, member=member, kafka_member_id=None,
                                          registered_at=at, seen_at=at, claimed_at=None))

    def seen(self, member: str, *, kafka_member_id: str | None = None, claimed: bool = False) -> None:
        """Refresh ``member``'s row: seen now, and its member id (when given) and first claim (once)."""
        t, at = self.table, now()
        values: dict[str, object] = {"seen_at": at}
        if kafka_member_id is not None:
            values["kafka_member_id"] = kafka_member_id
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            mine = (t.c.consumer_group == self.group) & (t.c.member == member)
            if conn.execute(update(t).where(mine).values(**values)).rowcount == 0:
                # Deleted meanwhile (by hand, say): this worker is still alive, so it is back.
                conn.execute(insert(t).values(consumer_group=self.group, member=member, registered_at=at,
                                              claimed_at=None, **values))
            if claimed:
                conn.execute(update(t).where(mine, t.c.claimed_at.is_(None)).values(claimed_at=at))

    def live(self, stale_after: float) -> list[Registered]:
        """The group's rows seen within ``stale_after`` seconds."""
        t = self.table
        with self.engine.connect() as conn:
            rows = conn.execute(select(t.c.member, t.c.kafka_member_id, t.c.seen_at, t.c.claimed_at)
                                .where(t.c.consumer_group == self.group)).all()
        current = now()
        return [Registered(row.member, row.kafka_member_id, row.claimed_at is not None) for row in rows
                if (current - aware(row.seen_at)).total_seconds() <= stale_after]

    def forget(self, member: str) -> None:
        """``member`` stops cleanly: its row goes."""
        t = self.table
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            conn.execute(delete(t).where(t.c.consumer_group == self.group, t.c.member == member))

