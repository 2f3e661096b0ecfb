"""An outbox's shards: made once with a fixed count (or made anew by :meth:`OutboxShards.reshard`),
read with their incarnation, and the database's clock every lease is measured by.

:class:`OutboxShards` is what every part of an outbox's statements shares (its engine, group,
tables and shard count): :mod:`kstore.relay.writing`, :mod:`kstore.relay.leases` and
:mod:`kstore.relay.backlog` build on it, and :class:`kstore.relay.store.Outbox` is all of them.

**Incarnations.** Shards are made with a random id, their incarnation. Every progress mark a
relay leaves in Kafka carries it, and every write and every relay read checks it: marks left by
shards made before (in another database, or in this one before a reshard) count for nothing, and
a writer or relay that read the old shards fails rather than number by the old count.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Connection, Engine, Float, delete, func, insert, literal_column, select
from sqlalchemy.sql.elements import ColumnElement

from kstore.db.writes import WRITES, now
from kstore.errors import OutboxBusyError, OutboxChangedError

from .lanes import lanes_of
from .tables import build_tables


class OutboxShards:
    """The shards of one group's outbox in one database (the base of :class:`kstore.relay.store.Outbox`)."""

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
        #: The one-statement writes (:mod:`kstore.relay.writing`), by their number of records.
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

    def _clock(self) -> ColumnElement[float]:
        """The database's time in seconds: one clock for every relay's lease, whatever the machines say."""
        if self.postgresql:
            return literal_column("extract(epoch from clock_timestamp())", Float)
        return literal_column("((julianday('now') - 2440587.5) * 86400.0)", Float)
