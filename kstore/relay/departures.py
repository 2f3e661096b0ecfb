"""Relays whose worker left the Kafka group: found once the group settles after a rebalance, and their
leases ended at once rather than when they run out.

A worker that crashed leaves its relay's lanes leased until the lease runs out
(``outbox_lease_s``), though its partitions moved once Kafka saw it gone. Relays are known in the
group by their worker's name (its client id); a standalone ``kstore relay`` is never in the group,
so never taken so. Ending a paused relay's lease is safe: the next owner's epoch and its
transactional producer fence it, as when a lease runs out.
"""

from __future__ import annotations

import logging
import threading
import time

from kstore.errors import BrokerError
from kstore.kafka.seam import GroupReader, GroupView

from .base import RelayBase
from .lanes import lane_shards

log = logging.getLogger(__name__)

#: After a rebalance, how often and for how long the group is described until it has settled
#: (to find relays whose worker left it: :meth:`Departures.group_changed`).
SETTLE_RECHECK_S = 0.5
SETTLE_PATIENCE_S = 30.0


class Departures(RelayBase):
    """A relay's watch on its worker's group (:meth:`group_changed`, on a thread of its own)."""

    def group_changed(self) -> None:
        """The worker's Kafka group rebalanced (called by the worker; returns at once).

        A worker that crashed leaves its relay's shards leased until the lease runs out
        (``outbox_lease_s``), though its partitions moved once Kafka saw it gone (the session
        timeout). So once the group settles, it is described: a relay that was a member the last
        time and is not now has lost its worker, and its shards are taken at once. Relays are
        known in the group by their worker's name, its client id: with ``client_id`` set, the
        lease alone decides; a standalone ``kstore relay`` is never in the group, so never taken so.
        """
        if self.settings.client_id:
            return
        with self._departures_lock:
            self._departures_due = True
            if self._departures_running:
                return
            self._departures_running = True
        threading.Thread(target=self._departures_loop, name="kstore-relay-group", daemon=True).start()
    def _departures_loop(self) -> None:
        while True:
            with self._departures_lock:
                if not self._departures_due or self._stop.is_set():
                    self._departures_running = False
                    return
                self._departures_due = False
            try:
                self._free_departed()
            except Exception as exc:  # the brokers or the database failed: the leases still run out
                log.debug("looking for relays whose worker left group %r failed: %s", self.group, exc)

    def _free_departed(self) -> None:
        seen: set[str] = set()
        live = self._settled_members(seen)
        if live is None:
            self._in_group |= seen
            return
        # A member listed while the group rebalanced counts too: a worker killed mid-rebalance
        # (after this relay's last settled view, or before its first) is in no settled view.
        gone, self._in_group = (self._in_group | seen) - live - {self.member}, live
        freed = self.outbox.expire(gone)
        if freed:
            shards = sorted(s for lane in freed for s in lane_shards(lane, self.outbox.shards))
            log.info("outbox shard(s) %s of group %r: their relay's worker left the group (%s); taken now, "
                     "not when the lease runs out", ", ".join(map(str, shards)), self.group,
                     ", ".join(sorted(set(freed.values()))))
        # Share the lanes anew now, not at the next heartbeat (up to a third of the lease away):
        # a worker that left cleanly released its shards, one that joined is owed its share.
        self._next_heartbeat = 0.0
        self._heartbeat_now.set()
        self._wake.set()

    def _settled_members(self, seen: set[str]) -> set[str] | None:
        """The group's members once it has settled, or None if it does not within SETTLE_PATIENCE_S;
        every member listed meanwhile, settled or not, is added to ``seen``."""
        deadline = time.monotonic() + SETTLE_PATIENCE_S
        while not self._stop.is_set():
            with self._admin_lock:
                if self._stop.is_set():  # the relay is closing its admin client
                    return None
                view = group_view(self._reader(), self.group)
            if view is not None:
                members = {m.client_id for m in view.members}
                seen |= members
                if view.settled:
                    return members
            if time.monotonic() > deadline:
                return None
            self._stop.wait(SETTLE_RECHECK_S)
        return None


def group_view(reader: GroupReader, group: str) -> GroupView | None:
    """The group's members and whether it is settled, or None if the brokers cannot say."""
    try:
        return reader.group_view(group)
    except BrokerError as exc:
        log.debug("describing group %r failed: %s", group, exc)
        return None


def settled_members(reader: GroupReader, group: str) -> set[str] | None:
    """The client ids of a group's members once it is settled (``Stable``), or None while it
    rebalances or if the brokers cannot say."""
    view = group_view(reader, group)
    return {m.client_id for m in view.members} if view is not None and view.settled else None
