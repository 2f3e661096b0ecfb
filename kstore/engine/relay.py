"""The outbox relay: publishes the records a group's batches produced, once their transactions
committed, to Kafka, exactly once for a ``read_committed`` reader, and per key in commit order.

It runs in the worker (a thread of its own: :meth:`Relay.start`) and standalone (``kstore
relay``: :meth:`Relay.run`). The outbox's shards are published in lanes (:mod:`kstore.db.outbox`:
a lane per shard, or, past :data:`~kstore.db.outbox.MAX_LANES` shards, that many lanes of several).
Each lane is published by one relay at a time: the one holding its lease in the database, whose
transactional producer (a :class:`~kstore.kafka.seam.ShardPublisher`, on the client
``relay_client`` names) fenced every earlier one when it started, before it published anything
(it starts once the lane has rows: a group that produces nothing makes no producer and no
progress topic). A lane is published in order:
its shards' rows after their progress, each shard's ``seq`` ascending, a transaction at a time;
the progress of each shard commits inside each Kafka transaction, so it is never ahead of or
behind what was published.

Nothing here skips a row. A row Kafka refuses stops its shard (the reason logged, then tried
again after a wait that doubles from :data:`BLOCKED_RETRY_FIRST_S` to :data:`BLOCKED_RETRY_S`);
a broker or database outage leaves the rows waiting, retried with a backoff; a transaction
whose outcome is unknown is settled by a new producer (``init_transactions``) and the progress
read again from Kafka.

**Threads.** :meth:`Relay.run` keeps the leases (a heartbeat every third of ``outbox_lease_s``)
and LISTENs; each lane it holds is published by a thread of its own (:meth:`Relay._lane_loop`),
so one lane's Kafka transaction never waits for another's: a transaction is a few round trips
to the brokers, and a record's latency is the one it lands in, plus the one before it. A lane's
thread owns that lane's producer and state; the lease thread only tells it to stop. The
database's "published" mark, only for clean-up and the backlog's count, is written at most once
a :data:`MARK_INTERVAL_S` (and when the shard is idle), off the path from commit to Kafka.
:meth:`Relay.turn` does one step of everything on the calling thread (tests drive it so).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from kstore.db.outbox import Backlog, Listener, Outbox, Pending, groups_with_outbox, lane_shards
from kstore.db.sqlerrors import first_line
from kstore.errors import BrokerError, BrokerNotReadyError, DatabaseError, OutboxChangedError
from kstore.kafka.clients import admin_reader, publisher_class
from kstore.kafka.seam import (
    PROGRESS_TOPIC_CONFIG,
    AdminReader,
    Fenced,
    GroupReader,
    GroupView,
    PublishFailed,
    ShardPublisher,
    progress_topic,
)
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics

from .member import member_name

log = logging.getLogger(__name__)

#: Rows per Kafka transaction, at most.
MAX_ROWS_PER_TRANSACTION = 5000
#: A shard stopped on a row Kafka refused is tried again after this long at first, the wait doubling
#: each time up to BLOCKED_RETRY_S: a topic made again is published to at once, a row that stays
#: refused costs a transaction every 30 s.
BLOCKED_RETRY_FIRST_S = 1.0
BLOCKED_RETRY_S = 30.0
#: A Kafka transaction under way this many times ``connect_timeout_s`` stops the relay (RelayStuck).
STUCK_AFTER_TIMEOUTS = 3
#: First and longest wait after the broker or the database failed a shard.
RETRY_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 10.0
#: After a rebalance, how often and for how long the group is described until it has settled
#: (to find relays whose worker left it: :meth:`Relay.group_changed`).
SETTLE_RECHECK_S = 0.5
SETTLE_PATIENCE_S = 30.0
#: After a shard's producer was fenced, how long before the lease is checked and a new one made.
FENCED_RETRY_S = 1.0
#: A lane whose shard a writer held locked as it was about to sleep looks for rows again after this long.
BUSY_RECHECK_S = 0.005
#: How often, at most, a busy shard writes its "published" mark (and deletes what it published).
MARK_INTERVAL_S = 1.0
#: How often a relay waiting for an application to set its outbox up looks for it: one count of a
#: small table, and an application's start takes seconds anyway; far below liveness_timeout_s.
WAIT_FOR_OUTBOX_S = 2.0
#: How many of the database's outboxes the line of a relay waiting for an unknown one names.
OUTBOXES_LISTED = 20
#: A lane's first producer, on a broker just started, meets "not now" answers (a coordinator still
#: loading) and backs off: routine, said at INFO for this long; a WARNING past it, when something keeps
#: the brokers from answering (a coordinator loads within seconds).
NOT_READY_ROUTINE_S = 30.0


@dataclass
class _Lane:
    """One held lane: written by its own thread (or by :meth:`Relay.turn`), told to stop by the lease thread."""

    lane: int
    shards: tuple[int, ...]
    epoch: int
    publisher: ShardPublisher | None = None
    #: The shards' incarnation its publisher's progress marks carry (read when it was made).
    incarnation: str | None = None
    #: The highest seq of each shard known published (read from Kafka when the publisher was made).
    published: dict[int, int] = field(default_factory=dict)
    #: The highest seq of each shard marked published in the database, and when.
    marked: dict[int, int] = field(default_factory=dict)
    marked_at: float = 0.0
    #: Not before this monotonic time is the lane tried again (a failure's backoff, a refused row).
    not_before: float = 0.0
    delay: float = RETRY_DELAY_S
    #: The (shard, seq) of the row Kafka refused, until the lane publishes again.
    blocked_on: tuple[int, int] | None = None
    #: The wait after the next refusal: doubled by each, back to the first once the lane publishes.
    blocked_delay: float = BLOCKED_RETRY_FIRST_S
    #: After a transaction in which Kafka refused a row, the lane publishes a row a transaction until
    #: each shard is published up to its seq here: the rows before the refused one go out, and the
    #: one to blame is named exactly (a broker refuses a whole request of records for one record too large).
    single_until: dict[int, int] = field(default_factory=dict)
    #: Since when (monotonic) a Kafka call of the lane has been under way; None between calls.
    publishing_since: float | None = None
    #: The relay's paused time (:attr:`Relay._paused_s`) when that call began.
    paused_before: float = 0.0
    #: The lease is no longer ours (found by the lane itself): the lease thread forgets it.
    lost: bool = False
    #: ``published`` when the lane last found rows committed as it was about to sleep (see
    #: Relay._sleep_until_written), None once it slept.
    woken_at: dict[int, int] | None = None
    last_error: str | None = None
    #: A producer was opened for the lane (after that, "not now" from the brokers is no longer routine).
    opened: bool = False
    #: Since when (monotonic) the brokers have answered the lane's first start "not now", and the last
    #: such failure said (at INFO).
    not_ready_since: float | None = None
    not_ready_said: str | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """How the log names it: ``shard 3`` for a lane of one shard, ``lane 3 (shards 3, 11, ...)``."""
        if len(self.shards) == 1:
            return f"shard {self.lane}"
        return f"lane {self.lane} (shards {', '.join(map(str, self.shards))})"

    @property
    def single(self) -> bool:
        return any(self.published.get(shard, 0) < seq for shard, seq in self.single_until.items())

    @property
    def unmarked(self) -> dict[int, int]:
        """The shards published further than their database mark says."""
        return {shard: seq for shard, seq in self.published.items() if seq > self.marked.get(shard, 0)}

    def upto(self) -> str:
        if len(self.shards) == 1:
            return str(self.published.get(self.shards[0], 0))
        return ", ".join(f"shard {shard} {seq}" for shard, seq in sorted(self.published.items()))

    def row_name(self, row: Pending) -> str:
        return f"row {row.seq}" if len(self.shards) == 1 else f"row {row.seq} of shard {row.shard}"


class RelayStuck(Exception):
    """A shard's Kafka call did not return long after its timeout: the relay stops."""


class _LostLane(Exception):
    """The lane's lease is no longer this relay's."""


class Relay:
    """Publishes one group's outbox. A plain object: :meth:`run` (or :meth:`start` for a thread),
    :meth:`wake` after a commit that produced records, :meth:`request_stop`, :meth:`close`.

    ``wait_for_outbox``: an application's outbox, whose shard count its application knows
    (``Outbox(name, shards=N)``): the relay never makes it, it waits until it exists. Otherwise (a
    group's, or ``kstore relay --outbox NAME --create``) it makes ``outbox_shards`` if none exist."""

    def __init__(self, settings: Settings, group: str, engine: Engine, metrics: Metrics | None = None,
                 member: str | None = None, wait_for_outbox: bool = False) -> None:
        self.settings = settings
        self.group = group
        self.wait_for_outbox = wait_for_outbox
        #: Why it does not publish yet, while it waits for the application to set the outbox up.
        self._waiting_for: str | None = None
        self.outbox = Outbox(engine, group, settings.table_prefix, settings.schema)
        self.member = member or member_name()
        self.metrics = metrics or Metrics(group)
        # Read at a scrape (kept a few seconds), not by the publishing loop: no statement while nobody
        # looks, and a scrape's answer is never older than that.
        self.metrics.watch_outbox(self._backlog)
        #: The lanes this relay holds, by number.
        self._held: dict[int, _Lane] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publisher_class = publisher_class(settings.relay_client)
        #: The shards' progress and the group's members, asked on the relay's client (made when first needed).
        self._admin: AdminReader | None = None
        self._admin_lock = threading.Lock()
        self._progress_topic_ready = False
        self._listener: Listener | None = None
        self._next_heartbeat = 0.0
        self._delay, self._not_before = RETRY_DELAY_S, 0.0
        #: The last error of the lease thread, and of any shard (each said once per distinct reason).
        self.last_error: str | None = None
        self._shard_reason: str | None = None
        #: What ended the relay's thread, if anything did (a bug): the worker stops on it.
        self.error: BaseException | None = None
        #: When the lease loop last turned, and whether it has read the shards (for the probes).
        self._turned_at = time.monotonic()
        self._running = False
        #: Time the process was seen not running (SIGSTOP, a frozen VM): the lease loop turned
        #: that much later than it can. Not counted against a Kafka transaction (see _check_stuck).
        self._paused_s = 0.0
        #: The group's members when last described settled; a relay among them that is gone the
        #: next time has lost its worker (see group_changed). Only the departures thread uses it.
        self._in_group: set[str] = set()
        self._departures_lock = threading.Lock()
        self._departures_due = self._departures_running = False
        #: Set when shards were freed: the lease loop takes them now, not at its next heartbeat.
        self._heartbeat_now = threading.Event()

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

    def _backlog(self) -> Backlog:
        """The outbox's backlog, for its gauges; a database error as its first line (no SQL in a log)."""
        try:
            return self.outbox.waiting()
        except SQLAlchemyError as exc:
            raise DatabaseError(first_line(exc)) from None

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

    def _ensure_progress_topic(self) -> None:
        """Make the group's progress topic (:func:`~kstore.kafka.seam.progress_topic`) if the cluster has
        none, before the first lane's publisher starts: a partition per lane, compacted. A topic with
        fewer partitions (the shards were made anew, more of them) is given more: a lane's partition
        is its number, so the others' stay where they are. (Callers hold ``_admin_lock``.)"""
        if self._progress_topic_ready:
            return
        topic, lanes = progress_topic(self.group), self.outbox.lanes
        reader = self._reader()
        created, counts = reader.create_missing([topic], lanes, None, PROGRESS_TOPIC_CONFIG)
        if created:
            log.info("created the outbox's progress topic %r: %d partition(s), compacted", topic, lanes)
        elif counts.get(topic, 0) < lanes:
            log.info("the outbox's progress topic %r has %d partition(s); adding partitions for %d lanes", topic,
                     counts.get(topic, 0), lanes)
            reader.add_partitions(topic, lanes)
        self._progress_topic_ready = True

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
                        state = _Lane(lane, lane_shards(lane, self.outbox.shards), claimed)
                        log.info("outbox relay %s publishes %s of group %r (epoch %d)", self.member, state.name,
                                 self.group, claimed)
                        self._held[lane] = state
        except SQLAlchemyError as exc:
            self._failed("renew the outbox leases", exc)
            return False
        self._delay, self.last_error = RETRY_DELAY_S, None
        return True

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
            _close_publisher(state)
        elif wait:
            state.thread.join(self.settings.connect_timeout_s)

    def _reap(self) -> None:
        """Forget the lanes whose own thread found the lease gone."""
        for lane, state in list(self._held.items()):
            if state.lost:
                self._stop_lane(lane)

    # -- one lane -----------------------------------------------------------------

    def _lane_loop(self, state: _Lane) -> None:
        """A held lane's thread: publish whenever there is something, until told to stop."""
        try:
            while not (state.stop.is_set() or state.lost):
                if not self._step(state):
                    state.wake.wait(self._lane_wait_s(state))
                    state.wake.clear()
        except BaseException as exc:
            self.error = exc
            log.exception("publishing outbox %s of group %r failed", state.name, self.group)
        finally:
            _close_publisher(state)

    def _lane_wait_s(self, state: _Lane) -> float:
        """Until the lane's retry is due; else until its mark is due or the next poll."""
        now = time.monotonic()
        if state.not_before > now:
            return state.not_before - now
        wait = self.settings.outbox_poll_interval_s
        if state.unmarked:
            wait = min(wait, state.marked_at + MARK_INTERVAL_S - now)
        return max(0.001, wait)

    def _step(self, state: _Lane) -> bool:
        """One publishing step of a lane: a transaction of what waits (True), or nothing to do."""
        if state.lost or time.monotonic() < state.not_before:
            return False
        try:
            if state.publisher is None:
                marks = self._rows_waiting(state)
                if marks is None:
                    return False
                self._open(state, *marks)
            return self._publish(state)
        except _LostLane:
            return False
        except SQLAlchemyError as exc:
            self._lane_failed(state, "read or mark it", exc)
        except BrokerError as exc:
            _close_publisher(state)
            self._lane_failed(state, "open its producer", exc)
        return False

    def _rows_waiting(self, state: _Lane) -> tuple[dict[int, int], str] | None:
        """The database's marks of a lane without a producer yet, and the shards' incarnation, if it has
        rows past them; None if it has none: a lane that has none (a group that produces nothing, or
        not yet) makes no producer and no progress topic. On PostgreSQL the next writer is asked for a
        NOTIFY first and the rows looked for after, so rows committed in between are found here, and
        rows committed later wake the lane."""
        marks, incarnation = self.outbox.published_marks(state.lane)
        self._check_incarnation(state, incarnation)
        if self.outbox.postgresql and self._ask_for_a_wakeup(state, marks) == "busy":
            return None
        return (marks, incarnation) if self.outbox.pending(marks, 1, incarnation) else None

    def _check_incarnation(self, state: _Lane, incarnation: str) -> None:
        """The shards were made anew (``kstore outbox reshard``) since this relay read their count: its
        lanes are the old count's, so it stops (the lane is given up, and :attr:`error` ends the relay:
        started again, it reads the new shards)."""
        if self.outbox.incarnation in (None, incarnation):
            return
        self.error = OutboxChangedError(
            f"the outbox of {self.group!r} was resharded while this relay ran (it shares the lanes of "
            f"{self.outbox.shards} shard(s)): it stops; start it again")
        state.lost = True
        raise _LostLane()

    def _ask_for_a_wakeup(self, state: _Lane, published: dict[int, int]) -> Literal["sleep", "publish", "busy"]:
        """:meth:`Outbox.sleep_until_written` for the lane's shards; a writer holding one of them
        (``"busy"``) has the lane look again after BUSY_RECHECK_S (or at its NOTIFY, if it takes the
        seq asked for)."""
        answer = self.outbox.sleep_until_written(published)
        if answer == "busy":
            state.not_before = time.monotonic() + BUSY_RECHECK_S
        return answer

    def _publish(self, state: _Lane) -> bool:
        assert state.publisher is not None
        rows = self.outbox.pending(state.published, 1 if state.single else MAX_ROWS_PER_TRANSACTION,
                                   state.incarnation)
        if not rows:
            self._mark(state, due=True)
            return self._sleep_until_written(state)
        marks = dict(state.published)
        for row in rows:
            marks[row.shard] = row.seq
        state.publishing_since, state.paused_before = time.monotonic(), self._paused_s
        try:
            state.publisher.publish([p.record for p in rows], marks, self.settings.connect_timeout_s)
        except Fenced as exc:
            # Another producer initialised the lane's transactional id. If the lease is still ours
            # (the other is a relay whose lease ran out, before its heartbeat told it), a new producer
            # of ours fences it in turn (see _open); if not, the lane is given up there.
            log.warning("outbox %s of group %r: another relay's producer took over (%s)", state.name, self.group,
                        exc)
            self.metrics.relay_fenced()
            _close_publisher(state)
            state.not_before = time.monotonic() + FENCED_RETRY_S
            return False
        except PublishFailed as exc:
            _close_publisher(state)
            if exc.row is None:
                self._lane_failed(state, "publish it", exc)
                return False
            if len(rows) > 1:
                state.single_until = {row.shard: row.seq for row in rows}  # each shard's last, in seq order
                log.warning("outbox %s of group %r: Kafka refused one of %d rows (%s); publishing them one a "
                            "transaction to find it", state.name, self.group, len(rows), exc)
                return False
            wait = state.blocked_delay
            state.not_before = time.monotonic() + wait
            state.blocked_on, state.blocked_delay = (rows[0].shard, rows[0].seq), min(wait * 2, BLOCKED_RETRY_S)
            # Said at every try, not once: an operator must act on it.
            log.error("outbox %s of group %r stopped on %s: Kafka refused it (%s); the rows wait, "
                      "nothing is skipped (tried again in %gs)", state.name, self.group, state.row_name(rows[0]),
                      exc, wait)
            self._note_refusal(rows[0], str(exc))
            return False
        finally:
            state.publishing_since = None
        state.published = marks
        state.blocked_on, state.blocked_delay = None, BLOCKED_RETRY_FIRST_S
        state.delay, state.last_error = RETRY_DELAY_S, None
        self._shard_reason = None
        self.metrics.published(len(rows), min(p.created_at for p in rows))
        self._mark(state, due=False)
        return True

    def _note_refusal(self, row: Pending, reason: str) -> None:
        """The refused row, for ``kstore outbox show`` and the console. Only informs: a database that
        cannot take it now leaves it to the next refusal, and the rows wait all the same."""
        try:
            self.outbox.note_refusal(row.shard, row.seq, reason)
        except SQLAlchemyError as exc:
            log.debug("could not note the refused row of shard %d: %s", row.shard, first_line(exc))

    def _sleep_until_written(self, state: _Lane) -> bool:
        """The lane has nothing to publish: on PostgreSQL, ask the next writer of each of its shards
        to NOTIFY (the relay LISTENs already: see :meth:`run`). True (publish on, do not sleep) if
        rows committed before the ask; only once in a row for the same rows, so rows that vanished
        (deleted by hand) cost a poll interval, not a busy loop."""
        if not self.outbox.postgresql:
            return False
        answer = self._ask_for_a_wakeup(state, state.published)
        if answer == "busy":
            return False
        if answer == "sleep" or state.published == state.woken_at:
            state.woken_at = None
            return False
        state.woken_at = dict(state.published)
        return True

    def _mark(self, state: _Lane, due: bool) -> None:
        """Write the lane's "published" marks and delete what they cover: when ``due`` (the lane is
        idle), or once a MARK_INTERVAL_S. Kafka's progress is the truth; this is only clean-up."""
        unmarked = state.unmarked
        if not unmarked:
            return
        now = time.monotonic()
        if not due and now < state.marked_at + MARK_INTERVAL_S:
            return
        if not self.outbox.mark_published(state.lane, state.epoch, self.member, unmarked):
            # Published (Kafka's progress holds it); the lease moved meanwhile: the next owner reads it there.
            log.warning("outbox %s of group %r was taken by another relay after publishing up to %s",
                        state.name, self.group, state.upto())
            state.lost = True
            raise _LostLane()
        state.marked.update(unmarked)
        state.marked_at = now

    def _open(self, state: _Lane, marked: dict[int, int], incarnation: str) -> None:
        """A new producer for the lane (fencing any earlier one), and its progress read from Kafka
        (``marked``: the database's marks of its shards, read with their ``incarnation``).

        Only while the lease is this relay's: a relay that lost it and does not know yet would
        otherwise fence the new holder's producer, and the two would take turns."""
        if not self.outbox.holds(self.member, state.lane, state.epoch):
            log.warning("outbox %s of group %r was taken by another relay: no longer publishing it",
                        state.name, self.group)
            state.lost = True
            raise _LostLane()
        with self._admin_lock:
            self._ensure_progress_topic()
        publisher = self._publisher_class(self.settings, self.group, state.lane,
                                          self.settings.outbox_max_record_bytes, incarnation)
        try:
            with self._admin_lock:
                in_kafka = publisher.progress(self._reader(), state.shards)
        except BaseException:
            publisher.close()
            raise
        state.publisher, state.marked, state.incarnation = publisher, marked, incarnation
        state.opened = True
        state.published = {shard: max(in_kafka.get(shard, 0), marked.get(shard, 0)) for shard in state.shards}
        log.info("outbox %s of group %r: published up to %s (Kafka's record), publishing on", state.name,
                 self.group, state.upto())
        # Published before, not marked (the last owner stopped in between): clean up now. (Should
        # this fail, the lane publishes on after its backoff, and marks with its next transaction.)
        self._mark(state, due=True)

    def _reader(self) -> AdminReader:
        """The relay's :class:`GroupReader` (callers hold ``_admin_lock``). It does not ask again after a
        "not now": the shard backs off and tries again (and the group is described again) by itself."""
        if self._admin is None:
            self._admin = admin_reader(self.settings, relay=True, patience_s=0)
        return self._admin

    def _lane_failed(self, state: _Lane, what: str, exc: BaseException) -> None:
        """Wait before trying the lane again (doubling up to RETRY_MAX_DELAY_S). Said once per
        reason, whichever lane meets it first (an outage fails them all alike), until a lane
        publishes again."""
        state.not_before = time.monotonic() + state.delay
        reason = f"could not {what}: {first_line(exc)}"
        log.log(self._failure_level(state, reason, exc), "outbox %s of group %r: %s; the rows wait (retrying in "
                "%.1fs)", state.name, self.group, reason, state.delay)
        state.delay = min(state.delay * 2, RETRY_MAX_DELAY_S)

    def _failure_level(self, state: _Lane, reason: str, exc: BaseException) -> int:
        """INFO for the brokers' "not now" at the lane's first start (:data:`NOT_READY_ROUTINE_S`), once per
        reason; otherwise WARNING, once per reason (DEBUG after)."""
        if self._routine(state, exc):
            level = logging.INFO if reason != state.not_ready_said else logging.DEBUG
            state.not_ready_said = reason
            return level
        level = logging.WARNING if reason not in (state.last_error, self._shard_reason) else logging.DEBUG
        state.last_error = self._shard_reason = reason
        return level

    @staticmethod
    def _routine(state: _Lane, exc: BaseException) -> bool:
        """A "not now" from the brokers before the lane's first producer opened, for NOT_READY_ROUTINE_S."""
        if state.opened or not isinstance(exc, BrokerNotReadyError):
            return False
        now = time.monotonic()
        if state.not_ready_since is None:
            state.not_ready_since = now
        return now - state.not_ready_since < NOT_READY_ROUTINE_S

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


def share(shards: int, counts: dict[str, int], me: str) -> int:
    """How many lanes relay ``me`` should take (> 0) or give up (-1), or 0, given how many each
    live relay holds (``counts``, ``me`` included), of ``shards`` lanes. Each ends with
    ``shards // relays`` or one more.

    One that holds less than its floor takes free lanes first: a relay with its floor only takes
    one more while nobody is below theirs, and a relay above the floor gives one up while someone
    is below it (so three relays on four shards end 2-1-1, not 2-2-0).
    """
    low, high = shards // len(counts), -(-shards // len(counts))
    mine, least = counts[me], min(counts.values())
    if mine > high or (mine > low and least < low and mine > least + 1):
        return -1
    if mine < low:
        return low - mine
    if mine < high and least >= low:
        return high - mine
    return 0


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


def _close_publisher(state: _Lane) -> None:
    if state.publisher is not None:
        state.publisher.close()
        state.publisher = None
