"""The outbox's tables and every statement on them: the rows a batch produces, written in its
transaction, and what the relay needs to publish them once (leases, progress, clean-up).

**Commit order.** Records are spread over a fixed number of shards by key (a key's records are
always in one shard). At the end of a batch that produced records, its transaction moves on the
``next_seq`` of each shard it writes (``UPDATE ... SET next_seq = next_seq + k ... RETURNING``,
a shard at a time in shard order, so two batches never deadlock), which locks the shard's row,
and numbers its records from the old value. The lock is held until COMMIT, so within a shard
``seq`` follows commit order, with no gap: a batch that waits for the lock reads ``next_seq`` only
after the one before it committed (or rolled back, leaving its numbers to the next). A relay that
has published up to ``seq`` N and reads ``seq > N`` can never skip a row that commits later: no
row below one it has seen can still be uncommitted. (Ordering by an id from a sequence would: ids
are taken in statement order, and transactions commit in another.) What a commit pays under the
lock: a few records of one shard (an application's request) are one statement on PostgreSQL (the
``UPDATE``, the rows' ``INSERT`` and the NOTIFY as data-modifying CTEs), then the COMMIT; more
records, an ``UPDATE`` per shard and one ``INSERT`` (COPY for many), then the COMMIT.

**Waking the relay.** A relay with nothing to publish in a shard asks for a NOTIFY before it
sleeps: it sets the shard's ``wake_seq`` to its ``next_seq`` (:meth:`Outbox.sleep_until_written`),
and the one writer whose records start at that seq NOTIFYs as it commits. The others send none:
PostgreSQL commits NOTIFYing transactions one at a time, so a NOTIFY per commit would bound the
commits of all shards together. Polling (``outbox_poll_interval_s``) stays the safety net: a
NOTIFY missed costs a poll interval, never a record.

**Who publishes a shard.** Shards are published in lanes: an outbox of up to :data:`MAX_LANES`
shards has a lane per shard; one of more has :data:`MAX_LANES` lanes, lane ``n`` publishing the
shards ``n``, ``n + MAX_LANES``, ... (:func:`lane_shards`). Many shards let many transactions commit
records side by side (a shard's row lock is held from its write to COMMIT); few lanes keep the
relay's Kafka side small (a lane is a lease, a transactional producer and a progress record).
One relay at a time publishes a lane, by lease (``outbox_relays``, the row of the lane's number):
taking a lane bumps its epoch, and every write of the relay's (its progress, the clean-up) matches
that epoch, so a paused relay's late writes land nowhere. The lease's clock is the database's, so
machines' clocks never disagree about it. Relays of one group share the lanes evenly: each says it
is alive in ``outbox_members``, and takes no more than its share. (Each shard's ``outbox_relays``
row keeps how far it was published.)
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from select import select as readable
from typing import Any, Literal, NamedTuple, cast

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
    and_,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from kstore.errors import KstoreError, OutboxBusyError, OutboxChangedError, WriteCountError
from kstore.types import Produced

from .copy import copy_rows
from .manyrows import execute_many
from .writes import WRITES, aware, now

log = logging.getLogger(__name__)

#: The outbox's columns a batch writes, in the order of its rows.
WRITE_COLUMNS = ("consumer_group", "shard", "seq", "topic", "partition_id", "key", "value", "headers", "created_at")
#: A batch that produced at least this many records writes them with COPY (PostgreSQL): a third
#: of a multi-row INSERT's CPU per record, for a round trip more.
COPY_FROM_ROWS = 64
#: A write of at most this many records, all of one shard (an application's request, most often),
#: is one statement on PostgreSQL: its numbering, rows and NOTIFY in one round trip under the lock.
FUSED_MAX_ROWS = 16

#: Lanes of an outbox of more shards than this (see the module's docstring). Fixed: a lane's shards
#: follow from the shard count alone, which is fixed once made, so every relay agrees on them.
MAX_LANES = 8

#: The PostgreSQL channel a transaction that took a shard's ``wake_seq`` notifies when it commits
#: (payload: its group).
CHANNEL = "kstore_outbox"


@dataclass(frozen=True)
class OutboxTables:
    outbox: Table
    shards: Table
    relays: Table
    members: Table


def build_tables(prefix: str = "kstore_", schema: str | None = None) -> OutboxTables:
    """The outbox's tables (migrations 0007, 0010 and 0012), named with ``prefix`` inside ``schema``."""
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
            # The seq its idle relay waits for (migration 0010): the transaction that takes it NOTIFYs.
            Column("wake_seq", BigInteger, nullable=True),
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
            # The last row Kafka refused in the shard (migration 0012): for the operator, never read to publish.
            Column("refused_seq", BigInteger, nullable=True),
            Column("refused_at", DateTime(timezone=True), nullable=True),
            Column("refused_reason", Text, nullable=True),
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


def lanes_of(shards: int) -> int:
    """How many lanes an outbox of ``shards`` shards is published in."""
    return min(shards, MAX_LANES)


def lane_shards(lane: int, shards: int) -> tuple[int, ...]:
    """The shards lane ``lane`` publishes, of an outbox of ``shards``."""
    return tuple(range(lane, shards, lanes_of(shards)))


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

    shard: int
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
    #: The relay holding the shard's lane, the lane's epoch and lease.
    owner: str | None
    epoch: int
    lease_left_s: float
    lane: int = 0
    #: The last row Kafka refused in the shard: see :class:`Refusal` (None: none yet).
    refused: Refusal | None = None


@dataclass(frozen=True)
class Refusal:
    """The last row of a shard Kafka refused: its seq, when, and Kafka's answer (no record contents)."""

    seq: int
    at: datetime
    reason: str


@dataclass(frozen=True)
class Backlog:
    """One outbox's records committed and not yet marked published (:func:`backlogs`): what the metrics,
    the console and ``kstore top`` say of every outbox alike."""

    #: The outbox's name: a group's (its processor's ``produce()``) or an application's (``Outbox(name)``).
    name: str
    waiting: int
    #: When the oldest of them was written (just before its transaction's commit), in UTC; None if none waits.
    oldest: datetime | None

    def age_s(self, at: datetime) -> float:
        """How long the oldest has waited at ``at``; 0 if none waits."""
        return 0.0 if self.oldest is None else max(0.0, (at - self.oldest).total_seconds())


def backlogs(conn: Connection, tables: OutboxTables, name: str | None = None) -> list[Backlog]:
    """Every outbox's backlog (or ``name``'s alone), by name, in one statement.

    Cheap however many rows wait: the rows are never counted nor scanned. A shard's count is its
    ``next_seq`` less its published mark (both move in the transactions that write and delete its
    rows, so they agree with the rows in any one snapshot), and its oldest row is its lowest ``seq``,
    one probe of the rows' primary key (group, shard, seq) per shard: the two small tables of shards
    are read whole, the rows' table once per shard."""
    s, r, o = tables.shards, tables.relays, tables.outbox
    first = (select(o.c.created_at).where(o.c.consumer_group == s.c.consumer_group, o.c.shard == s.c.shard)
             .order_by(o.c.seq).limit(1).correlate(s).scalar_subquery())
    shards = (select(s.c.consumer_group.label("name"), (s.c.next_seq - 1 - r.c.published_seq).label("waiting"),
                     first.label("oldest"))
              .join_from(s, r, and_(r.c.consumer_group == s.c.consumer_group, r.c.shard == s.c.shard)))
    if name is not None:
        shards = shards.where(s.c.consumer_group == name)
    per_shard = shards.subquery()
    rows = conn.execute(select(per_shard.c.name, func.sum(per_shard.c.waiting), func.min(per_shard.c.oldest))
                        .group_by(per_shard.c.name).order_by(per_shard.c.name)).all()
    return [Backlog(str(n), max(0, int(waiting or 0)), None if oldest is None else aware(oldest))
            for n, waiting, oldest in rows]


class Outbox:
    """The outbox of one group in one database."""

    def __init__(self, engine: Engine, group: str, prefix: str = "kstore_", schema: str | None = None) -> None:
        self.engine = engine
        self.group = group
        self.tables = build_tables(prefix, schema)
        self.postgresql = engine.dialect.name == "postgresql"
        #: The number of shards, fixed when the group's first worker or relay made them (see :meth:`ensure_shards`).
        self.shards = 0
        #: Their incarnation, read with them: a write that finds another one meets shards made anew since
        #: (:meth:`reshard`), numbered by another count, and fails rather than send a key to a wrong shard.
        self.incarnation: str | None = None
        #: Write by the plain path only (``SELECT ... FOR UPDATE``, an ``UPDATE`` per shard, SQLAlchemy's
        #: own executemany, a NOTIFY of its own): what the fast paths are tested against.
        self.plain = False
        #: The one-statement writes (:meth:`_write_fused`), by their number of records.
        self._fused: dict[int, str] = {}

    @property
    def lanes(self) -> int:
        """How many lanes the shards are published in (:func:`lanes_of`); 0 before the shards are known."""
        return lanes_of(self.shards)

    # -- shards ---------------------------------------------------------------

    def read_shards(self) -> int:
        """How many shards the group has (0: none yet), read with their incarnation; never makes any."""
        with self.engine.connect() as conn:
            return self._read_shards(conn)

    def _read_shards(self, conn: Connection) -> int:
        s = self.tables.shards
        have, incarnation = conn.execute(
            select(func.count(), func.min(s.c.incarnation)).where(s.c.consumer_group == self.group)).one()
        self.shards, self.incarnation = int(have), incarnation
        return self.shards

    def ensure_shards(self, wanted: int) -> int:
        """Make the group's shards if it has none (``wanted`` of them); return how many it has.

        The count is fixed once made: a key's records must stay in one shard for their order
        to hold. (To change it, once the outbox is drained and its relays stopped: :meth:`reshard`.)
        Safe to run again after any failure, a lost COMMIT's answer included: it makes the shards
        only where the group has none (two workers racing to make them: one fails, both see them).
        """
        if self.read_shards():  # read first, outside a write: no COMMIT when they exist
            return self.shards
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            if not self._read_shards(conn):
                self._make_shards(conn, wanted, next_seq=1, epoch=0)
        return self.shards

    def _make_shards(self, conn: Connection, count: int, next_seq: int, epoch: int) -> None:
        """``count`` shards of a new incarnation, numbering from ``next_seq``, their leases free at ``epoch``."""
        t = self.tables
        stamp, incarnation = now(), uuid.uuid4().hex
        conn.execute(insert(t.shards), [
            {"consumer_group": self.group, "shard": s, "next_seq": next_seq, "incarnation": incarnation}
            for s in range(count)])
        conn.execute(insert(t.relays), [
            {"consumer_group": self.group, "shard": s, "owner": None, "epoch": epoch, "lease_expires": 0.0,
             "published_seq": next_seq - 1, "updated_at": stamp} for s in range(count)])
        self.shards, self.incarnation = count, incarnation

    def reshard(self, wanted: int) -> int:
        """Make the group's shards anew, ``wanted`` of them, in one transaction; return how many it had
        (0: it has none, and nothing is made; the same count: nothing changes).

        Refused (:class:`~kstore.errors.OutboxBusyError`) while a record waits, a relay holds a live
        lease on a lane or a relay of the group is alive: every record written under the old count
        must be published before a key's next record may go to another shard, and a running relay
        shares the lanes by the old count. The shards' rows are locked first, in the writers' order:
        a writer in flight commits before (and its records are then found waiting), one after finds
        the shards made anew.

        Exactly once across it: every new shard numbers on from the highest ``next_seq`` of the old
        ones and its published mark is the number before it, so no number is ever given twice to a
        shard, and no progress mark in Kafka, however old, covers a row written after; the new
        incarnation makes the old marks count for nothing besides. The leases' epochs go on from the
        highest, so no late write of an earlier relay matches. A writer or relay that read the old
        shards meets the new incarnation and fails, rather than count by the old number (see
        :attr:`incarnation`).
        """
        t = self.tables
        s, r = t.shards, t.relays
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            old = conn.execute(select(s.c.next_seq).where(s.c.consumer_group == self.group)
                               .order_by(s.c.shard).with_for_update()).scalars().all()
            if not old or len(old) == wanted:
                self.shards = len(old)
                return len(old)
            leases = conn.execute(
                select(r.c.owner, r.c.epoch, (r.c.lease_expires >= self._clock()).label("live"))
                .where(r.c.consumer_group == self.group).order_by(r.c.shard).with_for_update()).all()
            self._check_drained(conn, {row.owner for row in leases if row.owner is not None and row.live})
            conn.execute(delete(r).where(r.c.consumer_group == self.group))
            conn.execute(delete(s).where(s.c.consumer_group == self.group))
            self._make_shards(conn, wanted, next_seq=max(int(n) for n in old),
                              epoch=max((int(row.epoch) for row in leases), default=0))
        return len(old)

    def _check_drained(self, conn: Connection, leased: set[str]) -> None:
        """Raise OutboxBusyError if a record of the group waits, or a relay of it is alive or holds a lease."""
        t = self.tables
        o, m = t.outbox, t.members
        waiting = conn.execute(select(func.count()).select_from(o).where(o.c.consumer_group == self.group)).scalar_one()
        alive = set(conn.execute(select(m.c.member).where(m.c.consumer_group == self.group,
                                                          m.c.seen_until >= self._clock())).scalars())
        relays = sorted(leased | alive)
        if not waiting and not relays:
            return
        why = [f"{waiting} record(s) wait to be published"] if waiting else []
        if relays:
            why.append(f"relay(s) {', '.join(relays)} are running (a stopped relay's lease runs out after "
                       f"outbox_lease_s)")
        raise OutboxBusyError(f"outbox {self.group!r} cannot be resharded now: {'; '.join(why)}: drain it first "
                              f"(stop the application's writes and let its relays publish what waits), then stop "
                              f"its relays")

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
        if self.postgresql and not self.plain and len(by_shard) == 1 and len(records) <= FUSED_MAX_ROWS:
            ((shard, mine),) = by_shard.items()
            self._write_fused(conn, shard, mine)
            return
        firsts, wake = self._number(conn, by_shard)
        stamp = now()
        values = [(self.group, shard, first + i, r.topic, r.partition, r.key, r.value, encode_headers(r.headers), stamp)
                  for shard, first in firsts.items() for i, r in enumerate(by_shard[shard])]
        self._insert(conn, values)
        if wake and self.postgresql:
            # Delivered when (and only if) the transaction commits: the shard's idle relay wakes at once.
            conn.execute(select(func.pg_notify(CHANNEL, self.group)))

    def _number(self, conn: Connection, by_shard: dict[int, list[Produced]]) -> tuple[dict[int, int], bool]:
        """Lock the shards' rows and move each one's ``next_seq`` past its records: the first seq
        each shard's records take (in shard order), and whether one is the seq its idle relay
        waits for (``wake_seq``: see :meth:`sleep_until_written`).

        In shard order: two writers lock their shards in the same order, and never deadlock. One
        ``UPDATE ... RETURNING`` per shard where the database has it (it takes the row lock as
        ``FOR UPDATE`` would), else (SQLite before 3.35, and :attr:`plain`) a ``SELECT ... FOR
        UPDATE`` of them all and an ``UPDATE`` of each."""
        s = self.tables.shards
        firsts: dict[int, int] = {}
        wake = False
        if self.plain or not conn.dialect.update_returning:
            found = conn.execute(
                select(s.c.shard, s.c.next_seq, s.c.wake_seq, s.c.incarnation)
                .where(s.c.consumer_group == self.group, s.c.shard.in_(sorted(by_shard)))
                .order_by(s.c.shard).with_for_update()).all()
            for shard, first, wake_seq, incarnation in found:
                self._check_incarnation(incarnation)
                moved = conn.execute(
                    update(s).where(s.c.consumer_group == self.group, s.c.shard == shard, s.c.next_seq == first)
                    .values(next_seq=first + len(by_shard[shard])))
                if moved.rowcount != 1:
                    raise KstoreError(f"outbox shard {shard} of group {self.group!r} moved under its lock")
                firsts[shard] = int(first)
                wake |= wake_seq == first
        else:
            for shard in sorted(by_shard):
                k = len(by_shard[shard])
                row = conn.execute(
                    update(s).where(s.c.consumer_group == self.group, s.c.shard == shard)
                    .values(next_seq=s.c.next_seq + k).returning(s.c.next_seq, s.c.wake_seq, s.c.incarnation)).first()
                if row is not None:
                    self._check_incarnation(row.incarnation)
                    firsts[shard] = int(row.next_seq) - k
                    wake |= row.wake_seq == firsts[shard]
        if len(firsts) != len(by_shard):
            missing = sorted(set(by_shard) - set(firsts))
            raise KstoreError(f"outbox shards of group {self.group!r} are missing: {missing}")
        return firsts, wake

    def _check_incarnation(self, found: str) -> None:
        """A shard locked for a write is of the incarnation read with the count, or the outbox was made
        anew since (:meth:`reshard`): its records would go to shards by the old count, so the write fails
        (its transaction rolls back) and the next one reads the shards again."""
        if self.incarnation is None or found == self.incarnation:
            return
        self.shards, self.incarnation = 0, None
        raise OutboxChangedError(f"the outbox of {self.group!r} was resharded since this process read its shards: "
                                 f"this transaction is rolled back, and the shards are read again before the "
                                 f"next (a worker stops: start it again)")

    def _insert(self, conn: Connection, values: list[tuple[Any, ...]]) -> None:
        """The rows, by the cheapest path that checks its row count (written on the worker's
        interpreter for every record a processor produces): COPY for many rows (kstore.db.copy; one
        round trip more than an INSERT, so not for a few), else one multi-row INSERT quoted by the
        driver (kstore.db.manyrows); SQLite (and :attr:`plain`) takes SQLAlchemy's own executemany."""
        if self.postgresql and not self.plain and len(values) >= COPY_FROM_ROWS:
            copy_rows(conn, self.tables.outbox, values, WRITE_COLUMNS)
            return
        rows = [dict(zip(WRITE_COLUMNS, row, strict=True)) for row in values]
        statement = insert(self.tables.outbox)
        if self.plain or execute_many(conn, statement, rows) is None:
            conn.execute(statement, rows)

    def _write_fused(self, conn: Connection, shard: int, records: Sequence[Produced]) -> None:
        """A few records of one shard in one statement (PostgreSQL): its numbering, its rows and,
        if they take the seq its idle relay waits for, the NOTIFY; the rows written counted."""
        n = len(records)
        statement = self._fused.get(n)
        if statement is None:
            statement = self._fused[n] = self._fused_statement(n)
        params: dict[str, Any] = {"g": self.group, "shard": shard, "n": n, "stamp": now(), "channel": CHANNEL}
        for i, r in enumerate(records):
            params[f"t{i}"], params[f"p{i}"], params[f"k{i}"], params[f"v{i}"], params[f"h{i}"] = (
                r.topic, r.partition, r.key, r.value, encode_headers(r.headers))
        # The driver's own SQL: no compiling or bind processing, the statement runs in a request's commit.
        row = conn.exec_driver_sql(statement, params).first()
        if row is None:
            raise KstoreError(f"outbox shards of group {self.group!r} are missing: [{shard}]")
        self._check_incarnation(row.inc)
        if row.written != n:
            raise WriteCountError(f"the outbox's write of {n} rows into shard {shard} of group {self.group!r} "
                                  f"reported {row.written} rows written: the transaction fails and nothing of it "
                                  f"commits")

    def _fused_statement(self, n: int) -> str:
        """``UPDATE`` the shard (its row lock) ``RETURNING`` the first seq, ``INSERT`` the ``n`` rows
        numbered from it, ``pg_notify`` if that seq is the shard's ``wake_seq``: one statement of
        data-modifying CTEs, every value a bound parameter cast to its column's type (a column of
        NULLs in a ``VALUES`` list would be text otherwise), in the driver's own style (``%(name)s``: both
        PostgreSQL drivers take it)."""
        q = self.engine.dialect.identifier_preparer
        # Names are quoted, and a "%" in them doubled: the driver reads "%(...)s" as a parameter.
        shards = q.format_table(self.tables.shards).replace("%", "%%")
        outbox = q.format_table(self.tables.outbox).replace("%", "%%")
        c = {name: q.quote(name) for name in (*WRITE_COLUMNS, "next_seq", "wake_seq", "incarnation")}
        rows = ", ".join(f"({i}, CAST(%(t{i})s AS TEXT), CAST(%(p{i})s AS INTEGER), CAST(%(k{i})s AS BYTEA), "
                         f"CAST(%(v{i})s AS BYTEA), CAST(%(h{i})s AS TEXT))" for i in range(n))
        return (
            f"WITH s AS (UPDATE {shards} SET {c['next_seq']} = {c['next_seq']} + %(n)s "
            f"WHERE {c['consumer_group']} = %(g)s AND {c['shard']} = %(shard)s "
            f"RETURNING {c['next_seq']} - %(n)s AS first, {c['wake_seq']} AS wake, {c['incarnation']} AS inc), "
            f"ins AS (INSERT INTO {outbox} ({', '.join(c[name] for name in WRITE_COLUMNS)}) "
            f"SELECT CAST(%(g)s AS TEXT), CAST(%(shard)s AS INTEGER), s.first + r.i, r.topic, r.partition_id, r.key, "
            f"r.value, r.headers, CAST(%(stamp)s AS TIMESTAMPTZ) "
            f"FROM s CROSS JOIN (VALUES {rows}) AS r (i, topic, partition_id, key, value, headers) RETURNING 1) "
            f"SELECT s.first, s.inc, (SELECT count(*) FROM ins) AS written, "
            f"CASE WHEN s.wake = s.first THEN pg_notify(CAST(%(channel)s AS TEXT), CAST(%(g)s AS TEXT)) END "
            f"AS woke FROM s")

    # -- the relay's sleep ------------------------------------------------------

    def sleep_until_written(self, published: Mapping[int, int]) -> Literal["sleep", "publish", "busy"]:
        """The relay of shards with nothing after ``published`` (``{shard: seq}``) is about to sleep:
        make each one's next seq the one whose writer NOTIFYs (``wake_seq``). ``"publish"`` if rows
        committed before it (publish them rather than sleep); ``"busy"`` if a writer holds a shard's
        row lock now (its rows come with its COMMIT: look again shortly); else ``"sleep"``: until a
        NOTIFY, or the poll. (PostgreSQL; LISTEN first.)

        A shard whose ``wake_seq`` is its committed ``next_seq`` needs nothing: the next writer takes
        that seq and NOTIFYs as it commits (a writer that rolls back leaves the seq, and the NOTIFY, to
        the next). Another's ``wake_seq`` is set under the shard's row lock, so it is ordered with the
        writers': one that committed before it moved ``next_seq`` (read here), one after it takes
        ``wake_seq`` as its first seq. A row a writer holds locked is skipped, never waited for: the
        ask would hold up every writer queued behind it. Only a hint: a NOTIFY missed costs a poll
        interval, never a record. Each statement runs alone, in autocommit (no BEGIN or COMMIT round
        trip, and never more than one shard's lock held: a writer takes several in shard order)."""
        s = self.tables.shards
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            rows = conn.execute(select(s.c.shard, s.c.next_seq, s.c.wake_seq).where(
                s.c.consumer_group == self.group, s.c.shard.in_(list(published)))).all()
            if any(int(row.next_seq) - 1 > published[row.shard] for row in rows):
                return "publish"
            for shard in sorted(row.shard for row in rows if row.wake_seq != row.next_seq):
                free = (select(s.c.shard).where(s.c.consumer_group == self.group, s.c.shard == shard)
                        .with_for_update(skip_locked=True).scalar_subquery())
                moved = conn.execute(
                    update(s).where(s.c.consumer_group == self.group, s.c.shard == free,
                                    s.c.wake_seq.is_distinct_from(s.c.next_seq))
                    .values(wake_seq=s.c.next_seq).returning(s.c.next_seq)).first()
                if moved is None:
                    return "busy"  # a writer holds the row (or took a seq since the read above)
                if int(moved.next_seq) - 1 > published[shard]:
                    return "publish"
        return "sleep"

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

    def free_lanes(self) -> list[int]:
        """Lanes no live relay holds (free, or their lease ran out), lowest first."""
        r = self.tables.relays
        with self.engine.connect() as conn:
            rows = conn.execute(select(r.c.shard).where(
                r.c.consumer_group == self.group, r.c.shard < self.lanes,
                or_(r.c.owner.is_(None), r.c.lease_expires < self._clock()))
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
        among the live relays. Returns the lanes freed, with who held them.

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

    def published_marks(self, lane: int) -> tuple[dict[int, int], str]:
        """How far the database says each of the lane's shards was published (the relay's marks;
        Kafka's word wins), and the shards' incarnation (what the progress marks in Kafka must carry
        to count)."""
        r, s = self.tables.relays, self.tables.shards
        with self.engine.connect() as conn:
            rows = conn.execute(select(r.c.shard, r.c.published_seq, s.c.incarnation).join(
                s, (s.c.consumer_group == r.c.consumer_group) & (s.c.shard == r.c.shard)).where(
                r.c.consumer_group == self.group, r.c.shard.in_(lane_shards(lane, self.shards)))).all()
        return {int(row.shard): int(row.published_seq) for row in rows}, str(rows[0].incarnation)

    def pending(self, after: Mapping[int, int], limit: int, incarnation: str | None = None) -> list[Pending]:
        """The rows of the shards in ``after`` (``{shard: seq}``) after that seq, at most ``limit``, in
        ``seq`` order (then shard): each shard's rows in order, and a shard's only after its earlier ones.

        With ``incarnation`` (the one a lane's progress marks carry), none unless the shards are still of
        it, read in the same statement: a relay paused across a reshard, its producer never fenced, must
        not publish rows of the new shards under marks that count for nothing."""
        o, s = self.tables.outbox, self.tables.shards
        query = (select(o.c.shard, o.c.seq, o.c.topic, o.c.value, o.c.key, o.c.headers, o.c.partition_id,
                        o.c.created_at)
                 .where(o.c.consumer_group == self.group,
                        or_(*(and_(o.c.shard == shard, o.c.seq > seq) for shard, seq in sorted(after.items()))))
                 .order_by(o.c.seq, o.c.shard).limit(limit))
        if incarnation is not None:
            # Uncorrelated: read once per statement, by the shards' primary key.
            current = select(s.c.incarnation).where(s.c.consumer_group == self.group,
                                                    s.c.shard == min(after)).scalar_subquery()
            query = query.where(current == incarnation)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        # Unpacked as tuples and built without a call per column: this runs for every record the
        # relay publishes, on the worker's interpreter.
        return [Pending(int(shard), int(seq), Produced(topic, None if value is None else bytes(value),
                                                       None if key is None else bytes(key),
                                                       decode_headers(headers) if headers else (), partition_id),
                        created if created.tzinfo is not None else created.replace(tzinfo=timezone.utc))
                for shard, seq, topic, value, key, headers, partition_id, created in rows]

    def mark_published(self, lane: int, epoch: int, member: str, marks: Mapping[int, int]) -> bool:
        """Record that each shard of ``marks`` (``{shard: seq}``, shards of the lane) is published up to
        its seq and delete those rows, under the relay's epoch of the lane. False if the lane is no
        longer this relay's (nothing was written)."""
        t = self.tables
        r, o = t.relays, t.outbox
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            held = conn.execute(
                update(r).where(r.c.consumer_group == self.group, r.c.shard == lane, r.c.epoch == epoch,
                                r.c.owner == member).values(updated_at=now()))
            if held.rowcount != 1:
                conn.rollback()
                return False
            for shard, seq in sorted(marks.items()):
                conn.execute(update(r).where(r.c.consumer_group == self.group, r.c.shard == shard,
                                             r.c.published_seq < seq).values(published_seq=seq))
                conn.execute(delete(o).where(o.c.consumer_group == self.group, o.c.shard == shard, o.c.seq <= seq))
        return True

    # -- what an operator and the metrics see ---------------------------------

    def state(self) -> list[ShardState]:
        """Every shard of the group: rows waiting, the oldest, the relay publishing its lane."""
        t = self.tables
        o, s, r = t.outbox, t.shards, t.relays
        with self.engine.connect() as conn:
            clock = conn.execute(select(self._clock())).scalar_one()
            waiting = {row.shard: (int(row.n), row.oldest) for row in conn.execute(
                select(o.c.shard, func.count().label("n"), func.min(o.c.created_at).label("oldest"))
                .where(o.c.consumer_group == self.group).group_by(o.c.shard))}
            rows = conn.execute(
                select(s.c.shard, s.c.next_seq, r.c.published_seq, r.c.owner, r.c.epoch, r.c.lease_expires,
                       r.c.refused_seq, r.c.refused_at, r.c.refused_reason)
                .join(r, (r.c.consumer_group == s.c.consumer_group) & (r.c.shard == s.c.shard))
                .where(s.c.consumer_group == self.group).order_by(s.c.shard)).all()
        lanes = lanes_of(len(rows))
        states = []
        for row in rows:
            lane = int(row.shard) % lanes
            lease = rows[lane]  # the lane's lease is in the row of its number (rows are in shard order)
            refused = (None if row.refused_seq is None
                       else Refusal(int(row.refused_seq), aware(row.refused_at), row.refused_reason or ""))
            states.append(ShardState(int(row.shard), int(row.next_seq), int(row.published_seq),
                                     *waiting.get(row.shard, (0, None)), lease.owner, int(lease.epoch),
                                     max(0.0, float(lease.lease_expires) - float(clock)), lane, refused))
        return states

    def note_refusal(self, shard: int, seq: int, reason: str) -> None:
        """Note that Kafka refused the shard's row ``seq`` (see :class:`Refusal`). Only informs the
        operator's tools: any relay may write it, and publishing never reads it."""
        r = self.tables.relays
        with self.engine.connect().execution_options(**WRITES) as conn, conn.begin():
            conn.execute(r.update().where(r.c.consumer_group == self.group, r.c.shard == shard)
                         .values(refused_seq=seq, refused_at=now(), refused_reason=reason))

    def backlog(self) -> tuple[int, datetime | None]:
        """Records committed but not yet marked published, over all shards, and when the oldest was
        written: :meth:`waiting`'s."""
        found = self.waiting()
        return found.waiting, found.oldest

    def waiting(self) -> Backlog:
        """The outbox's :class:`Backlog`, in one cheap statement (:func:`backlogs`); none waits in an
        outbox with no shards yet."""
        with self.engine.connect() as conn:
            found = backlogs(conn, self.tables, self.group)
        return found[0] if found else Backlog(self.group, 0, None)


def groups_with_outbox(conn: Connection, tables: OutboxTables) -> Iterable[str]:
    return [row[0] for row in conn.execute(select(tables.shards.c.consumer_group).distinct())]


class Listener:
    """A PostgreSQL connection that LISTENs on :data:`CHANNEL`: :meth:`wait` returns when a transaction
    that took a shard's ``wake_seq`` committed (any group's: a spurious wake-up costs one query)."""

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

