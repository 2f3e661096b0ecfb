"""The outbox relay: publishes the records a group's batches (or an application's transactions)
produced, once their transactions committed, to Kafka, exactly once for a ``read_committed`` reader,
and per key in commit order (the invariants: :mod:`kstore.relay`).

It runs in the worker (a thread of its own: :meth:`Relay.start`) and standalone (``kstore relay``:
:meth:`Relay.run`). The outbox's shards are published in lanes (:mod:`kstore.relay.lanes`). Each
lane is published by one relay at a time: the one holding its lease in the database
(:mod:`kstore.relay.leases`), whose transactional producer (a :class:`~kstore.relay.publisher.LanePublisher`
on the client ``relay_client`` names) fenced every earlier one when it started, before it published
anything (it starts once the lane has rows: a group that produces nothing makes no producer and no
progress topic). A lane is published in order (:mod:`kstore.relay.publishing`): its shards' rows
after their progress, each shard's ``seq`` ascending, a transaction at a time; the progress of each
shard commits inside each Kafka transaction (:mod:`kstore.relay.progress`), so it is never ahead of
or behind what was published.

**Threads.** :meth:`Relay.run` keeps the leases (a heartbeat every third of ``outbox_lease_s``)
and LISTENs; each lane it holds is published by a thread of its own, so one lane's Kafka
transaction never waits for another's: a transaction is a few round trips to the brokers, and a
record's latency is the one it lands in, plus the one before it. A lane's thread owns that lane's
producer and state; the lease thread only tells it to stop. The database's "published" mark, only
for clean-up and the backlog's count, is written at most once a
:data:`~kstore.relay.lane.MARK_INTERVAL_S` (and when the shard is idle), off the path from commit
to Kafka. :meth:`Relay.turn` does one step of everything on the calling thread (tests drive it so).
Relays whose worker left the group are found by :mod:`kstore.relay.departures`.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.exc import SQLAlchemyError

from kstore.db.sqlerrors import first_line

from .departures import Departures
from .lane import RETRY_DELAY_S, RETRY_MAX_DELAY_S, Lane, RelayStuck, close_publisher
from .lanes import lane_shards, share
from .listener import Listener
from .publishing import LanePublishing
from .tables import groups_with_outbox

log = logging.getLogger(__name__)

#: A Kafka transaction under way this many times ``connect_timeout_s`` stops the relay (RelayStuck).
STUCK_AFTER_TIMEOUTS = 3
#: How often a relay waiting for an application to set its outbox up looks for it: one count of a
#: small table, and an application's start takes seconds anyway; far below liveness_timeout_s.
WAIT_FOR_OUTBOX_S = 2.0
#: How many of the database's outboxes the line of a relay waiting for an unknown one names.
OUTBOXES_LISTED = 20


class Relay(LanePublishing, Departures):
    """Publishes one group's outbox. A plain object: :meth:`run` (or :meth:`start` for a thread),
    :meth:`wake` after a commit that produced records, :meth:`request_stop`, :meth:`close`.

    ``wait_for_outbox``: an application's outbox, whose shard count its application knows
    (``Outbox(name, shards=N)``): the relay never makes it, it waits until it exists. Otherwise (a
    group's, or ``kstore relay --outbox NAME --create``) it makes ``outbox_shards`` if none exist."""

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Publish on threads of its own (the worker's way)."""
        self._thread = threading.Thread(target=self._run_logged, name="kstore-relay", daemon=True)
        self._thread.start()

    def _run_logged(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # the worker stops on it (Worker.step): nothing would publish its records
            self.error = exc
            log.exception("the outbox relay of group %r failed; its shards are released", self.group)

    def run(self) -> None:
        """Publish until :meth:`request_stop`: keep the leases here, publish each held shard on a thread."""
        if not self._find_shards():
            return
        log.info("outbox relay %s for group %r: %d shard(s)", self.member, self.group, self.outbox.shards)
        self._running = True
        try:
            while not self._stop.is_set():
                self._turn()
                if self.error is not None:  # a shard's thread died: its shard would be held and never published
                    raise self.error
                self._check_stuck()
                if time.monotonic() >= self._next_heartbeat:
                    self._heartbeat()
                self._reap()
                self._listen()  # before a shard's thread asks a writer to NOTIFY (see _sleep_until_written)
                for state in list(self._held.values()):
                    if state.thread is None:
                        state.thread = threading.Thread(target=self._lane_loop, args=(state,),
                                                        name=f"kstore-relay-{state.lane}", daemon=True)
                        state.thread.start()
                self._idle(max(0.001, self._next_heartbeat - time.monotonic()))
        finally:
            self._release_all()

    def _find_shards(self) -> bool:
        """The outbox's shards, made if it has none or waited for (see ``wait_for_outbox``); False if
        told to stop first."""
        while not self._stop.is_set():
            self._turned_at = time.monotonic()  # waiting is this loop turning: /livez stays healthy
            try:
                if self._shards_known():
                    return True
                wait = WAIT_FOR_OUTBOX_S
            except SQLAlchemyError as exc:
                self._failed("read the outbox's shards", exc)
                wait = self._delay
            self._stop.wait(wait)
        return False

    def _shards_known(self) -> bool:
        if not self.wait_for_outbox:
            self.outbox.ensure_shards(self.settings.outbox_shards)
            return True
        if self.outbox.read_shards():
            if self._waiting_for is not None:
                log.info("outbox %r was set up with %d shard(s): publishing it", self.group, self.outbox.shards)
                self._waiting_for = None
            return True
        if self._waiting_for is None:  # said once: the wait may be long, and is no fault
            self._waiting_for = self._missing_outbox()
            log.warning(self._waiting_for)
        return False

    def _missing_outbox(self) -> str:
        """The line a relay waiting for an outbox that does not exist says, with those that do."""
        with self.outbox.engine.connect() as conn:
            known = sorted(groups_with_outbox(conn, self.outbox.tables))
        listed = ", ".join(known[:OUTBOXES_LISTED]) + (
            f" and {len(known) - OUTBOXES_LISTED} more" if len(known) > OUTBOXES_LISTED else "")
        name = self.group
        return (f"outbox {name!r} does not exist yet: waiting for the application to set it up "
                f"(Outbox({name!r}).setup() or its first produce()), or start the relay with --create to make "
                f"it here; " + (f"the database has outboxes: {listed}" if known else "the database has no outbox yet"))

    def liveness(self) -> tuple[bool, str]:
        """Healthy while the lease loop keeps turning (it turns at least every lease/3 seconds) and
        no shard's Kafka transaction is stuck (see :meth:`_check_stuck`)."""
        idle, limit = time.monotonic() - self._turned_at, self.settings.liveness_timeout_s
        if idle > max(limit, self.settings.outbox_lease_s):
            return False, f"the relay's lease loop has not turned for {idle:.0f}s"
        try:
            self._check_stuck()
        except RelayStuck as exc:
            return False, str(exc)
        return True, "the relay's lease loop is turning"

    def readiness(self) -> tuple[bool, str]:
        """Ready once it has read the outbox's shards, while its last lease round reached the database."""
        if not self._running:
            return False, self.last_error or self._waiting_for or "reading the outbox's shards"
        if self.last_error is not None:
            return False, self.last_error
        blocked = self.shards_blocked
        held = f"{len(self.shards_held)} of {self.outbox.shards} shard(s) held here"
        return True, held + (f", shard(s) {', '.join(map(str, blocked))} stopped on a row Kafka refused"
                             if blocked else "")

    def _turn(self) -> None:
        """The lease loop turns: a gap longer than a turn can take (its wait, then a heartbeat's
        round trip to the database) is time the process was paused, and is added up."""
        now = time.monotonic()
        lease = self.settings.outbox_lease_s
        longest = lease / 3 + (self.settings.db_timeout_s or lease) + 1.0
        self._paused_s += max(0.0, now - self._turned_at - longest)
        self._turned_at = now

    def _check_stuck(self) -> None:
        """A shard whose Kafka transaction has not returned long past its timeout stops the relay
        (and so the worker that runs it, for its supervisor to start again): its thread cannot be
        interrupted, and the lease this relay keeps renewing would hold the shard unpublished.
        (The publishers give up on a call long past its timeout themselves: this is the last net.)
        The time the process was paused is not counted: a worker woken after a SIGSTOP finds its
        transaction fenced, it is not stuck."""
        limit = STUCK_AFTER_TIMEOUTS * self.settings.connect_timeout_s
        now = time.monotonic()
        for state in list(self._held.values()):
            since = state.publishing_since
            if since is None:
                continue
            running = now - since - (self._paused_s - state.paused_before)
            if running > limit:
                raise RelayStuck(f"publishing outbox {state.name} of group {self.group!r}: a Kafka "
                                 f"transaction has not returned in {running:.0f}s (its timeout is "
                                 f"{self.settings.connect_timeout_s:g}s)")

    def wake(self) -> None:
        """A batch that produced records committed: publish now, not at the next poll."""
        for state in list(self._held.values()):
            state.wake.set()
        self._wake.set()

    def request_stop(self) -> None:
        self._stop.set()
        self.wake()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the threads (if :meth:`start` made them) and give the shards up."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        else:
            self._release_all()

    @property
    def shards_held(self) -> list[int]:
        """The shards of the lanes this relay holds."""
        return sorted(s for st in list(self._held.values()) if not st.lost for s in st.shards)

    @property
    def shards_blocked(self) -> list[int]:
        """Shards stopped on a row Kafka refused (see the ERROR line naming it)."""
        return sorted(st.blocked_on[0] for st in list(self._held.values()) if st.blocked_on is not None)

    # -- the leases (the relay's own thread) -------------------------------------

    def turn(self) -> bool:
        """One step of everything on the calling thread: the heartbeat when due, then one publishing
        step of each held shard. True if anything was published. (``run`` does the same on threads.)"""
        if time.monotonic() >= self._next_heartbeat and not self._heartbeat():
            return False
        busy = False
        for state in list(self._held.values()):
            busy |= self._step(state)
        self._reap()
        return busy

    def _heartbeat(self) -> bool:
        """Renew the held leases, give up what is more than this relay's share, take free lanes up to it."""
        lease = self.settings.outbox_lease_s
        self._next_heartbeat = time.monotonic() + lease / 3
        if time.monotonic() < self._not_before:
            return False
        try:
            held = {n: st.epoch for n, st in list(self._held.items()) if not st.lost}
            kept, counts = self.outbox.heartbeat(self.member, held, lease)
            for lane in set(held) - kept:
                log.warning("outbox %s of group %r was taken by another relay: no longer publishing it",
                            self._held[lane].name, self.group)
                self._stop_lane(lane)
            action = share(self.outbox.lanes, counts, self.member)
            if action < 0:
                lane = max(kept)
                state = self._held[lane]
                log.info("outbox relay %s gives %s up (%d relays share %d lanes)", self.member, state.name,
                         len(counts), self.outbox.lanes)
                self._stop_lane(lane)
                self.outbox.release(self.member, lane, state.epoch)
            elif action > 0:
                for lane in self.outbox.free_lanes()[:action]:
                    claimed = self.outbox.claim(self.member, lane, lease)
                    if claimed is not None:
                        state = Lane(lane, lane_shards(lane, self.outbox.shards), claimed)
                        log.info("outbox relay %s publishes %s of group %r (epoch %d)", self.member, state.name,
                                 self.group, claimed)
                        self._held[lane] = state
        except SQLAlchemyError as exc:
            self._failed("renew the outbox leases", exc)
            return False
        self._delay, self.last_error = RETRY_DELAY_S, None
        return True

    def _stop_lane(self, lane: int, wait: bool = False) -> None:
        """Tell a lane's thread to stop (it closes its producer on its way out) and forget the lane.

        Not waited for but at shutdown: a thread in the middle of a Kafka call must not hold up
        the heartbeat of the other leases. Should this relay take the lane again meanwhile, its
        new producer fences the old one's."""
        state = self._held.pop(lane, None)
        if state is None:
            return
        state.stop.set()
        state.wake.set()
        if state.thread is None:
            close_publisher(state)
        elif wait:
            state.thread.join(self.settings.connect_timeout_s)

    def _reap(self) -> None:
        """Forget the lanes whose own thread found the lease gone."""
        for lane, state in list(self._held.items()):
            if state.lost:
                self._stop_lane(lane)

    # -- helpers ----------------------------------------------------------------

    def _idle(self, seconds: float) -> None:
        """Wait for a wake-up (this worker's commit, a NOTIFY from another's) or ``seconds``; pass it on."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self._listener is None:
                self._wake.wait(left)
                break
            if self._heartbeat_now.is_set():
                break
            try:
                if self._listener.wait(min(left, 0.2)):
                    self.wake()
            except Exception as exc:
                log.debug("the LISTEN connection failed (polling instead): %s", exc)
                self._listener.close()
                self._listener = None
        self._wake.clear()
        self._heartbeat_now.clear()

    def _listen(self) -> None:
        """LISTEN (PostgreSQL), if not yet or no longer: a NOTIFY sent while nobody listens is lost.
        Once listening again, every held shard looks for rows (one may have asked for a NOTIFY
        meanwhile, and slept)."""
        if self._listener is not None or not self.outbox.postgresql:
            return
        try:
            self._listener = Listener(self.outbox.engine)
        except Exception as exc:  # the pool raises the driver's own error, unwrapped
            log.debug("LISTEN failed (polling instead): %s", exc)
            return
        self.wake()

    def _failed(self, what: str, exc: BaseException) -> None:
        """The lease thread waits before trying again (doubling up to RETRY_MAX_DELAY_S); said once per reason."""
        self._not_before = time.monotonic() + self._delay
        text = (f"outbox relay of group {self.group!r} could not {what}: {first_line(exc)}; "
                f"the rows wait (retrying in {self._delay:.1f}s)")
        if text != self.last_error:
            log.warning(text)
        self.last_error = text
        self._delay = min(self._delay * 2, RETRY_MAX_DELAY_S)

    def _release_all(self) -> None:
        for lane in list(self._held):
            epoch = self._held[lane].epoch
            self._stop_lane(lane, wait=True)
            try:
                self.outbox.release(self.member, lane, epoch)
            except SQLAlchemyError as exc:
                log.debug("releasing lane %d failed (its lease runs out): %s", lane, exc)
        try:
            self.outbox.leave(self.member)
        except SQLAlchemyError as exc:
            log.debug("leaving the relays failed: %s", exc)
        for closer in (self._listener, self._admin):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:
                    log.debug("closing failed: %s", exc)
        self._listener = self._admin = None
