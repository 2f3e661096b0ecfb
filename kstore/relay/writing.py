"""The outbox's write, inside a batch's (or an application's) transaction: each record numbered in
commit order within its shard, by the cheapest statements that keep that order.

See :mod:`kstore.relay` for why ``seq`` follows commit order: the shard's row lock, taken by the
``UPDATE`` of its ``next_seq``, is held from the write to COMMIT. What a commit pays under the lock:
a few records of one shard (an application's request) are one statement on PostgreSQL (the
``UPDATE``, the rows' ``INSERT`` and the NOTIFY as data-modifying CTEs), then the COMMIT; more
records, an ``UPDATE`` per shard and one ``INSERT`` (COPY for many), then the COMMIT. Only the
writer whose first seq is the shard's ``wake_seq`` NOTIFYs (see
:meth:`kstore.relay.backlog.OutboxBacklog.sleep_until_written`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from kstore.db.copy import copy_rows
from kstore.db.manyrows import execute_many
from kstore.db.writes import now
from kstore.errors import KstoreError, WriteCountError
from kstore.types import Produced

from .lanes import shard_of
from .shards import OutboxShards
from .tables import CHANNEL, WRITE_COLUMNS, encode_headers

#: A batch that produced at least this many records writes them with COPY (PostgreSQL): a third
#: of a multi-row INSERT's CPU per record, for a round trip more.
COPY_FROM_ROWS = 64
#: A write of at most this many records, all of one shard (an application's request, most often),
#: is one statement on PostgreSQL: its numbering, rows and NOTIFY in one round trip under the lock.
FUSED_MAX_ROWS = 16


class OutboxWrites(OutboxShards):
    """Writing an outbox's records, numbered per shard in commit order."""

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
