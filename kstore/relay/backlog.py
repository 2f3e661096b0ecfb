"""What waits in an outbox and how far it was published: the rows a relay reads, the published marks
it writes (and the clean-up with them), the ask for a NOTIFY before it sleeps, and the shards as
the operator's tools and the metrics see them.

The database's published mark is only clean-up and the backlog's count: the progress that decides
what is published is the one in Kafka (:mod:`kstore.relay.progress`), committed in each
transaction with the records; a relay takes the further of the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Literal

from sqlalchemy import and_, delete, func, or_, select, update

from kstore.db.writes import WRITES, aware, now
from kstore.types import Produced

from .lanes import lane_shards, lanes_of
from .shards import OutboxShards
from .tables import Backlog, Pending, Refusal, ShardState, backlogs, decode_headers


class OutboxBacklog(OutboxShards):
    """An outbox's rows waiting, as the relay and the operator see them."""

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
