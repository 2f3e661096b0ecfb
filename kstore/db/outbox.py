"""The outbox's tables and every statement on them: the rows a batch produces, written in its
transaction, and what the relay needs to publish them once (leases, progress, clean-up).

**Commit order.** Records are spread over a fixed number of shards by key (a key's records are
always in one shard). At the end of a batch that produced records, its transaction locks the
rows of the shards it writes (``SELECT ... ORDER BY shard FOR UPDATE``: in shard order, so two
batches never deadlock), numbers its records from each shard's ``next_seq`` and moves it on.
The lock is held until COMMIT, so within a shard ``seq`` follows commit order, with no gap: a
batch that waits for the lock reads ``next_seq`` only after the one before it committed (or
rolled back, leaving its numbers to the next). A relay that has published up to ``seq`` N and
reads ``seq > N`` can never skip a row that commits later: no row below one it has seen can
still be uncommitted. (Ordering by an id from a sequence would: ids are taken in statement
order, and transactions commit in another.)

**Who publishes a shard.** One relay at a time, by lease (``outbox_relays``): taking a shard
bumps its epoch, and every write of the relay's (its progress, the clean-up) matches that
epoch, so a paused relay's late writes land nowhere. The lease's clock is the database's, so
machines' clocks never disagree about it. Relays of one group share the shards evenly: each
says it is alive in ``outbox_members``, and takes no more than its share.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from select import select as readable
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from kstore.errors import KstoreError
from kstore.types import Produced

from .copy import copy_rows
from .manyrows import execute_many
from .writes import WRITES, aware, now

log = logging.getLogger(__name__)

#: The PostgreSQL channel a batch that produced records notifies when it commits (payload: its group).
#: The outbox's columns a batch writes, in the order of its rows.
WRITE_COLUMNS = ("consumer_group", "shard", "seq", "topic", "partition_id", "key", "value", "headers", "created_at")
#: A batch that produced at least this many records writes them with COPY (PostgreSQL): a third
#: of a multi-row INSERT's CPU per record, for a round trip more.
COPY_FROM_ROWS = 64

CHANNEL = "kstore_outbox"


@dataclass(frozen=True)
class OutboxTables:
    outbox: Table
    shards: Table
    relays: Table
    members: Table


def build_tables(prefix: str = "kstore_", schema: str | None = None) -> OutboxTables:
    """The outbox's tables (migration 0007), named with ``prefix`` inside ``schema``."""
    md = MetaData(schema=schema)
    return OutboxTables(
        Table(
            f"{prefix}outbox", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("shard", Integer, primary_key=True),
            Column("seq", BigInteger, primary_key=True, autoincrement=False),
            Column("topic", String(255), nullable=False),
            Column("partition_id", Integer, nullable=True),
            Column("key", LargeBinary, nullable=True),
            Column("value", LargeBinary, nullable=True),
            Column("headers", Text, nullable=True),
            Column("created_at", DateTime(timezone=True), nullable=False),
        ),
        Table(
            f"{prefix}outbox_shards", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("shard", Integer, primary_key=True, autoincrement=False),
            Column("next_seq", BigInteger, nullable=False),
            Column("incarnation", String(32), nullable=False),
        ),
        Table(
            f"{prefix}outbox_relays", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("shard", Integer, primary_key=True, autoincrement=False),
            Column("owner", String(255), nullable=True),
            Column("epoch", BigInteger, nullable=False),
            Column("lease_expires", Float, nullable=False),
            Column("published_seq", BigInteger, nullable=False),
            Column("updated_at", DateTime(timezone=True), nullable=False),
        ),
        Table(
            f"{prefix}outbox_members", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("member", String(255), primary_key=True),
            Column("seen_until", Float, nullable=False),
        ),
    )


def shard_of(record: Produced, shards: int) -> int:
    """The shard a record goes to: by key, so that one key's records keep their commit order;
    a record without a key by its topic (keyless records of one topic keep theirs)."""
    basis = record.key if record.key is not None else record.topic.encode()
    return zlib.crc32(basis) % shards


def encode_headers(headers: Sequence[tuple[str, bytes | None]]) -> str | None:
    if not headers:
        return None
    return json.dumps([[n, None if v is None else base64.b64encode(v).decode()] for n, v in headers])


def decode_headers(text: str | None) -> tuple[tuple[str, bytes | None], ...]:
    if not text:
        return ()
    return tuple((n, None if v is None else base64.b64decode(v)) for n, v in json.loads(text))


class Pending(NamedTuple):
    """An outbox row waiting to be published (a tuple: a relay reads thousands at a time)."""

    seq: int
    record: Produced
    #: When its batch wrote it (just before its commit), in UTC.
    created_at: datetime


@dataclass(frozen=True)
class ShardState:
    """One shard as ``kstore outbox show`` and the metrics see it."""

    shard: int
    next_seq: int
    published_seq: int
    waiting: int
    oldest: datetime | None
    owner: str | None
    epoch: int
    lease_left_s: float


class Outbox:
    """The outbox of one group in one database."""

    def __init__(self, engine: Engine, group: str, prefix: str = "kstore_", schema: str | None = None) -> None:
        self.engine = engine
        self.group = group
        self.tables = build_tables(prefix, schema)
        self.postgresql = engine.dialect.name == "postgresql"
        #: The number of shards, fixed when the group's first worker or relay made them (see :meth:`ensure_shards`).
        self.shards = 0

    # -- shards ---------------------------------------------------------------

    def ensure_shards(self, wanted: int) -> int:
        """Make the group's shards if it has none (``wanted`` of them); return how many it has.

        The count is fixed once made: a key's records must stay in one shard for their order
        to hold. (To change it: stop the group's workers and relays once the outbox is empty, delete
        the group's rows of the four outbox tables, and start them with the new count. The shards
        made then have a new incarnation: the old progress marks in Kafka count for nothing.)
        Safe to run again after any failure, a lost COMMIT's answer included: it makes the shards
        only where the group has none (two workers racing to make them: one fails, both see them).
        """
        t = self.tables
        count = select(func.count()).select_from(t.shards).where(t.shards.c.consumer_group == self.group)
        with self.engine.connect() as conn:  # read first, outside a write: no COMMIT when they exist
            have = conn.execute(count).scalar_one()
        if have:
            self.shards = int(have)
            return self.shards
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            have = conn.execute(count).scalar_one()
            if not have:
                stamp, incarnation = now(), uuid.uuid4().hex
                conn.execute(insert(t.shards), [
                    {"consumer_group": self.group, "shard": s, "next_seq": 1, "incarnation": incarnation}
                    for s in range(wanted)])
                conn.execute(insert(t.relays), [
                    {"consumer_group": self.group, "shard": s, "owner": None, "epoch": 0, "lease_expires": 0.0,
                     "published_seq": 0, "updated_at": stamp} for s in range(wanted)])
                have = wanted
        self.shards = int(have)
        return self.shards

    # -- inside a batch's transaction -----------------------------------------

    def write(self, conn: Connection, records: Sequence[Produced]) -> None:
        """Write a batch's produced records, numbered in commit order per shard (see the module's
        docstring). Call it last in the transaction, just before the offsets: the shards' row locks
        are held from here to COMMIT."""
        if not records:
            return
        if not self.shards:
            raise KstoreError("the outbox's shards are not known: call Outbox.ensure_shards() first")
        by_shard: dict[int, list[Produced]] = defaultdict(list)
        for record in records:
            by_shard[shard_of(record, self.shards)].append(record)
        s = self.tables.shards
        # In shard order: two batches lock their shards in the same order, and never deadlock.
        found = conn.execute(
            select(s.c.shard, s.c.next_seq)
            .where(s.c.consumer_group == self.group, s.c.shard.in_(sorted(by_shard)))
            .order_by(s.c.shard).with_for_update()
        ).all()
        if len(found) != len(by_shard):
            raise KstoreError(f"outbox shards of group {self.group!r} are missing: "
                              f"{sorted(set(by_shard) - {row.shard for row in found})}")
        stamp = now()
        values: list[tuple[Any, ...]] = []
        for shard, next_seq in found:
            mine = by_shard[shard]
            values.extend((self.group, shard, next_seq + i, r.topic, r.partition, r.key, r.value,
                           encode_headers(r.headers), stamp) for i, r in enumerate(mine))
            moved = conn.execute(
                update(s).where(s.c.consumer_group == self.group, s.c.shard == shard, s.c.next_seq == next_seq)
                .values(next_seq=next_seq + len(mine)))
            if moved.rowcount != 1:
                raise KstoreError(f"outbox shard {shard} of group {self.group!r} moved under its lock")
        # Written on the worker's interpreter for every record a processor produces, so by the
        # cheapest path that checks its row count: COPY for many rows (kstore.db.copy; one round
        # trip more than an INSERT, so not for a few), else one multi-row INSERT quoted by the
        # driver (kstore.db.manyrows); SQLite takes SQLAlchemy's own executemany.
        if self.postgresql and len(values) >= COPY_FROM_ROWS:
            copy_rows(conn, self.tables.outbox, values, WRITE_COLUMNS)
        else:
            rows = [dict(zip(WRITE_COLUMNS, row, strict=True)) for row in values]
            statement = insert(self.tables.outbox)
            if execute_many(conn, statement, rows) is None:
                conn.execute(statement, rows)
        if self.postgresql:
            # Delivered when (and only if) the transaction commits: the relays wake at once.
            conn.execute(select(func.pg_notify(CHANNEL, self.group)))

    # -- the relay's leases ---------------------------------------------------

    def _clock(self) -> ColumnElement[float]:
        """The database's time in seconds: one clock for every relay's lease, whatever the machines say."""
        if self.postgresql:
            return literal_column("extract(epoch from clock_timestamp())", Float)
        return literal_column("((julianday('now') - 2440587.5) * 86400.0)", Float)

    def heartbeat(self, member: str, held: dict[int, int], lease_s: float) -> tuple[set[int], dict[str, int]]:
        """Say ``member`` is alive and renew the leases it holds (``{shard: epoch}``).

        Returns the shards still held (a shard missing was taken by another relay: stop
        publishing it) and, for each relay of the group alive now (this one included), how many
        shards it holds: what the relays share the shards by.
        """
        t = self.tables
        m, r = t.members, t.relays
        clock = self._clock()
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            seen = conn.execute(update(m).where(m.c.consumer_group == self.group, m.c.member == member)
                                .values(seen_until=clock + lease_s))
            if seen.rowcount == 0:
                conn.execute(insert(m).values(consumer_group=self.group, member=member, seen_until=clock + lease_s))
            conn.execute(delete(m).where(m.c.consumer_group == self.group, m.c.seen_until < clock - lease_s))
            kept = set()
            for shard, epoch in held.items():
                renewed = conn.execute(
                    update(r).where(r.c.consumer_group == self.group, r.c.shard == shard, r.c.owner == member,
                                    r.c.epoch == epoch).values(lease_expires=clock + lease_s))
                if renewed.rowcount == 1:
                    kept.add(shard)
            alive = {row.member: 0 for row in conn.execute(
                select(m.c.member).where(m.c.consumer_group == self.group, m.c.seen_until >= clock))}
            for row in conn.execute(select(r.c.owner, func.count().label("n")).where(
                    r.c.consumer_group == self.group, r.c.owner.is_not(None), r.c.lease_expires >= clock)
                    .group_by(r.c.owner)):
                if row.owner in alive:
                    alive[row.owner] = int(row.n)
        alive[member] = len(kept)
        return kept, alive

    def claim(self, member: str, shard: int, lease_s: float) -> int | None:
        """Take a shard whose lease is free or expired; its new epoch, or None if another relay holds it.

        A shard whose row another transaction has locked is skipped (None; tried again at the next
        heartbeat): that may be a paused relay stopped inside its mark, and waiting for it would hold
        up the heartbeat, and so every lease this relay holds, until the database ends its session."""
        r = self.tables.relays
        clock = self._clock()
        free = or_(r.c.owner.is_(None), r.c.lease_expires < clock, r.c.owner == member)
        unlocked = (select(r.c.shard).where(r.c.consumer_group == self.group, r.c.shard == shard, free)
                    .with_for_update(skip_locked=True).scalar_subquery())
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            row = conn.execute(
                update(r).where(r.c.consumer_group == self.group, r.c.shard == unlocked, free)
                .values(owner=member, epoch=r.c.epoch + 1, lease_expires=clock + lease_s, updated_at=now())
                .returning(r.c.epoch)
            ).first()
        return None if row is None else int(row.epoch)

    def holds(self, member: str, shard: int, epoch: int) -> bool:
        """Whether ``member`` still holds the shard's lease at ``epoch`` (and it has not run out)."""
        r = self.tables.relays
        with self.engine.connect() as conn:
            return conn.execute(select(r.c.shard).where(
                r.c.consumer_group == self.group, r.c.shard == shard, r.c.owner == member, r.c.epoch == epoch,
                r.c.lease_expires >= self._clock())).first() is not None

    def free_shards(self) -> list[int]:
        """Shards no live relay holds (free, or their lease ran out), lowest first."""
        r = self.tables.relays
        with self.engine.connect() as conn:
            rows = conn.execute(select(r.c.shard).where(
                r.c.consumer_group == self.group, or_(r.c.owner.is_(None), r.c.lease_expires < self._clock()))
                .order_by(r.c.shard)).all()
        return [int(row.shard) for row in rows]

    def release(self, member: str, shard: int, epoch: int) -> None:
        """Give a shard up (its lease ends now), so another relay can take it at once."""
        r = self.tables.relays
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            conn.execute(update(r).where(r.c.consumer_group == self.group, r.c.shard == shard, r.c.owner == member,
                                         r.c.epoch == epoch).values(owner=None, lease_expires=0.0, updated_at=now()))

    def expire(self, members: Iterable[str]) -> dict[int, str]:
        """End the leases of relays known to be gone (their worker left the Kafka group), so live
        relays take their shards now instead of when the leases run out; they no longer count
        among the live relays. Returns the shards freed, with who held them.

        Safe even if such a relay is only paused: the next owner's epoch and its transactional
        producer fence it, as when a lease runs out."""
        gone = sorted(set(members))
        if not gone:
            return {}
        r, m = self.tables.relays, self.tables.members
        clock = self._clock()
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            freed = conn.execute(
                update(r).where(r.c.consumer_group == self.group, r.c.owner.in_(gone), r.c.lease_expires >= clock)
                .values(lease_expires=0.0, updated_at=now()).returning(r.c.shard, r.c.owner)).all()
            conn.execute(delete(m).where(m.c.consumer_group == self.group, m.c.member.in_(gone)))
        return {int(row.shard): str(row.owner) for row in freed}

    def leave(self, member: str) -> None:
        """``member`` stops: it is no longer counted among the live relays."""
        m = self.tables.members
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            conn.execute(delete(m).where(m.c.consumer_group == self.group, m.c.member == member))

    # -- publishing -----------------------------------------------------------

    def published_mark(self, shard: int) -> tuple[int, str]:
        """How far the database says the shard was published (the relay's mark; Kafka's word wins),
        and the shards' incarnation (what the progress marks in Kafka must carry to count)."""
        r, s = self.tables.relays, self.tables.shards
        with self.engine.connect() as conn:
            row = conn.execute(select(r.c.published_seq, s.c.incarnation).join(
                s, (s.c.consumer_group == r.c.consumer_group) & (s.c.shard == r.c.shard)).where(
                r.c.consumer_group == self.group, r.c.shard == shard)).one()
        return int(row.published_seq), str(row.incarnation)

    def pending(self, shard: int, after: int, limit: int) -> list[Pending]:
        """The shard's rows after ``seq`` ``after``, in order, at most ``limit``."""
        o = self.tables.outbox
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(o.c.seq, o.c.topic, o.c.value, o.c.key, o.c.headers, o.c.partition_id, o.c.created_at)
                .where(o.c.consumer_group == self.group, o.c.shard == shard, o.c.seq > after)
                .order_by(o.c.seq).limit(limit)
            ).all()
        # Unpacked as tuples and built without a call per column: this runs for every record the
        # relay publishes, on the worker's interpreter.
        return [Pending(int(seq), Produced(topic, None if value is None else bytes(value),
                                           None if key is None else bytes(key),
                                           decode_headers(headers) if headers else (), partition_id),
                        created if created.tzinfo is not None else created.replace(tzinfo=timezone.utc))
                for seq, topic, value, key, headers, partition_id, created in rows]

    def mark_published(self, shard: int, epoch: int, member: str, seq: int) -> bool:
        """Record that the shard is published up to ``seq`` and delete those rows, under the
        relay's epoch. False if the shard is no longer this relay's (nothing was written)."""
        t = self.tables
        r, o = t.relays, t.outbox
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            marked = conn.execute(
                update(r).where(r.c.consumer_group == self.group, r.c.shard == shard, r.c.epoch == epoch,
                                r.c.owner == member, r.c.published_seq <= seq)
                .values(published_seq=seq, updated_at=now()))
            if marked.rowcount != 1:
                conn.rollback()
                return False
            conn.execute(delete(o).where(o.c.consumer_group == self.group, o.c.shard == shard, o.c.seq <= seq))
        return True

    # -- what an operator and the metrics see ---------------------------------

    def state(self) -> list[ShardState]:
        """Every shard of the group: rows waiting, the oldest, its relay."""
        t = self.tables
        o, s, r = t.outbox, t.shards, t.relays
        with self.engine.connect() as conn:
            clock = conn.execute(select(self._clock())).scalar_one()
            waiting = {row.shard: (int(row.n), row.oldest) for row in conn.execute(
                select(o.c.shard, func.count().label("n"), func.min(o.c.created_at).label("oldest"))
                .where(o.c.consumer_group == self.group).group_by(o.c.shard))}
            rows = conn.execute(
                select(s.c.shard, s.c.next_seq, r.c.published_seq, r.c.owner, r.c.epoch, r.c.lease_expires)
                .join(r, (r.c.consumer_group == s.c.consumer_group) & (r.c.shard == s.c.shard))
                .where(s.c.consumer_group == self.group).order_by(s.c.shard)).all()
        return [ShardState(int(row.shard), int(row.next_seq), int(row.published_seq),
                           *waiting.get(row.shard, (0, None)), row.owner, int(row.epoch),
                           max(0.0, float(row.lease_expires) - float(clock)))
                for row in rows]

    def backlog(self) -> tuple[int, datetime | None]:
        """Records committed but not yet marked published, over all shards, and when the oldest was
        written. Cheap: two small tables, and one index lookup per shard (its lowest seq is its oldest)."""
        t = self.tables
        o, s, r = t.outbox, t.shards, t.relays
        with self.engine.connect() as conn:
            total = conn.execute(
                select(func.coalesce(func.sum(s.c.next_seq - 1 - r.c.published_seq), 0))
                .select_from(s.join(r, (r.c.consumer_group == s.c.consumer_group) & (r.c.shard == s.c.shard)))
                .where(s.c.consumer_group == self.group)).scalar_one()
            oldest = [conn.execute(select(o.c.created_at).where(o.c.consumer_group == self.group, o.c.shard == shard)
                                   .order_by(o.c.seq).limit(1)).scalar() for shard in range(self.shards)]
        stamps = [aware(stamp) for stamp in oldest if stamp is not None]
        return int(total), min(stamps, default=None)


def groups_with_outbox(conn: Connection, tables: OutboxTables) -> Iterable[str]:
    return [row[0] for row in conn.execute(select(tables.shards.c.consumer_group).distinct())]


class Listener:
    """A PostgreSQL connection that LISTENs on :data:`CHANNEL`: :meth:`wait` returns when a batch
    that produced records committed (any group's: a spurious wake-up costs one query)."""

    def __init__(self, engine: Engine) -> None:
        self._raw = engine.raw_connection()
        self._conn: Any = cast(Any, self._raw.driver_connection)
        self._psycopg2 = engine.dialect.driver == "psycopg2"
        if self._psycopg2:
            self._conn.autocommit = True
            with self._conn.cursor() as cur:
                cur.execute(f"LISTEN {CHANNEL}")
        else:
            self._conn.autocommit = True
            self._conn.execute(f"LISTEN {CHANNEL}")

    def wait(self, timeout_s: float) -> bool:
        """True if a notification came within ``timeout_s``."""
        if self._psycopg2:
            conn = self._conn
            conn.poll()
            if not conn.notifies and readable([conn], [], [], timeout_s)[0]:
                conn.poll()
            got = bool(conn.notifies)
            conn.notifies.clear()
            return got
        return any(True for _ in self._conn.notifies(timeout=timeout_s, stop_after=1))

    def close(self) -> None:
        """Drop the connection (never back into the pool: it LISTENs); a dead one is no error."""
        try:
            self._raw.invalidate()
            self._raw.close()
        except Exception as exc:
            log.debug("closing the LISTEN connection failed: %s", exc)

