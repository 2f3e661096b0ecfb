"""Who publishes a lane: the leases in ``outbox_relays`` (the row of the lane's number) and the live
relays in ``outbox_members``, every statement timed by the database's clock.

Taking a lane bumps its epoch; every later write of the relay's (its published marks, its
clean-up) matches that epoch, so a paused relay's late writes land nowhere. A relay says it is
alive at each heartbeat and takes no more than its share (:func:`kstore.relay.lanes.share`).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, func, insert, or_, select, update

from kstore.db.writes import WRITES, now

from .shards import OutboxShards


class OutboxLeases(OutboxShards):
    """The leases of an outbox's lanes, and the relays alive."""

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
