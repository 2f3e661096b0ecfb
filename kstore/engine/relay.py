"""The outbox relay: publishes the records a group's batches produced, once their transactions
committed, to Kafka, exactly once for a ``read_committed`` reader, and per key in commit order.

It runs in the worker (a thread of its own: :meth:`Relay.start`) and standalone (``kstore
relay``: :meth:`Relay.run`). Each outbox shard (:mod:`kstore.db.outbox`) is published by one
relay at a time: the one holding its lease in the database, whose transactional producer
(:mod:`kstore.kafka.producer`) fenced every earlier one when it started. A shard is published
in order: rows after the shard's progress, ``seq`` ascending, a transaction at a time; the
progress commits inside each Kafka transaction, so it is never ahead of or behind what was
published.

Nothing here skips a row. A row Kafka refuses stops its shard (the reason logged, then tried
again after :data:`BLOCKED_RETRY_S`); a broker or database outage leaves the rows waiting,
retried with a backoff; a transaction whose outcome is unknown is settled by a new producer
(``init_transactions``) and the progress read again from Kafka.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from kstore.db.outbox import Listener, Outbox
from kstore.db.sqlerrors import first_line
from kstore.errors import BrokerError
from kstore.kafka.producer import Fenced, PublishFailed, ShardPublisher, open_progress_reader
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: Rows per Kafka transaction, at most.
MAX_ROWS_PER_TRANSACTION = 5000
#: A shard stopped on a row Kafka refused is tried again after this long (the topic may be made).
BLOCKED_RETRY_S = 30.0
#: First and longest wait after the broker or the database failed the relay.
RETRY_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 10.0


#: After a shard's producer was fenced, how long before the lease is checked and a new one made.
FENCED_RETRY_S = 1.0


class _LostShard(Exception):
    """The shard's lease is no longer this relay's."""


@dataclass
class _Shard:
    epoch: int
    publisher: ShardPublisher | None = None
    #: The highest seq known published (read from Kafka when the publisher was made).
    published: int = 0
    #: A row Kafka refused: not before this monotonic time is the shard tried again.
    blocked_until: float = 0.0
    #: The seq of the row Kafka refused, until the shard publishes again.
    blocked_on: int | None = None


class Relay:
    """Publishes one group's outbox. A plain object: :meth:`run` (or :meth:`start` for a thread),
    :meth:`wake` after a commit that produced records, :meth:`request_stop`, :meth:`close`."""

    def __init__(self, settings: Settings, group: str, engine: Engine, database_id: str,
                 metrics: Metrics | None = None, member: str | None = None) -> None:
        self.settings = settings
        self.group = group
        #: The database's identity, in every progress mark the relay commits to Kafka.
        self.database_id = database_id
        self.outbox = Outbox(engine, group, settings.table_prefix, settings.schema)
        self.member = member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.metrics = metrics or Metrics(group)
        self._held: dict[int, _Shard] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._admin: Any = None
        self._listener: Listener | None = None
        self._next_heartbeat = 0.0
        self._delay, self._not_before = RETRY_DELAY_S, 0.0
        #: The last error that stopped the relay from publishing (for the logs' dedup and `outbox show`).
        self.last_error: str | None = None
        #: What ended the relay's thread, if anything did (a bug): the worker stops on it.
        self.error: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Publish on a thread of its own (the worker's way)."""
        self._thread = threading.Thread(target=self._run_logged, name="kstore-relay", daemon=True)
        self._thread.start()

    def _run_logged(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # the worker stops on it (Worker.step): nothing would publish its records
            self.error = exc
            log.exception("the outbox relay of group %r failed; its shards are released", self.group)

    def run(self) -> None:
        """Publish until :meth:`request_stop`."""
        while not self._stop.is_set():
            try:
                self.outbox.ensure_shards(self.settings.outbox_shards)
                break
            except SQLAlchemyError as exc:
                self._failed("read the outbox's shards", exc)
                self._stop.wait(self._delay)
        if self._stop.is_set():
            return
        log.info("outbox relay %s for group %r: %d shard(s)", self.member, self.group, self.outbox.shards)
        try:
            while not self._stop.is_set():
                busy = self.turn()
                if not busy and not self._stop.is_set():
                    self._idle(self._wait_s())
        finally:
            self._release_all()

    def wake(self) -> None:
        """A batch that produced records committed: publish now, not at the next poll."""
        self._wake.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (if :meth:`start` made one) and give the shards up."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        else:
            self._release_all()

    @property
    def shards_held(self) -> list[int]:
        return sorted(self._held)

    @property
    def shards_blocked(self) -> list[int]:
        """Held shards stopped on a row Kafka refused (see the ERROR line naming it)."""
        return sorted(s for s, st in list(self._held.items()) if st.blocked_on is not None)

    # -- one turn ---------------------------------------------------------------

    def turn(self) -> bool:
        """Heartbeat when due, then publish what each held shard has waiting; True if anything was published."""
        if time.monotonic() >= self._next_heartbeat and not self._heartbeat():
            return False
        if time.monotonic() < self._not_before:
            return False
        busy = False
        for shard in list(self._held):
            try:
                busy |= self._publish(shard)
            except SQLAlchemyError as exc:
                self._failed(f"read or mark shard {shard}", exc)
                return False
            except BrokerError as exc:
                self._drop_publisher(shard)
                self._failed(f"open shard {shard}'s producer", exc)
                return False
        return busy

    def _heartbeat(self) -> bool:
        """Renew the held leases, give up what is more than this relay's share, take free shards up to it."""
        lease = self.settings.outbox_lease_s
        self._next_heartbeat = time.monotonic() + lease / 3
        try:
            kept, alive = self.outbox.heartbeat(self.member, {s: st.epoch for s, st in self._held.items()}, lease)
            for shard in set(self._held) - kept:
                log.warning("outbox shard %d of group %r was taken by another relay: no longer publishing it",
                            shard, self.group)
                self._forget(shard)
            share = math.ceil(self.outbox.shards / alive)
            if len(self._held) > share:
                shard = max(self._held)
                log.info("outbox relay %s gives shard %d up (%d relays share %d shards)", self.member, shard,
                         alive, self.outbox.shards)
                epoch = self._held[shard].epoch
                self._forget(shard)
                self.outbox.release(self.member, shard, epoch)
            elif len(self._held) < share:
                for shard in self.outbox.free_shards()[: share - len(self._held)]:
                    claimed = self.outbox.claim(self.member, shard, lease)
                    if claimed is not None:
                        log.info("outbox relay %s publishes shard %d of group %r (epoch %d)", self.member, shard,
                                 self.group, claimed)
                        self._held[shard] = _Shard(claimed)
        except SQLAlchemyError as exc:
            self._failed("renew the outbox leases", exc)
            return False
        return True

    def _publish(self, shard: int) -> bool:
        state = self._held[shard]
        if state.blocked_until > time.monotonic():
            return False
        if state.publisher is None:
            try:
                self._open(shard, state)
            except _LostShard:
                return False
        assert state.publisher is not None
        rows = self.outbox.pending(shard, state.published, MAX_ROWS_PER_TRANSACTION)
        if not rows:
            return False
        try:
            state.publisher.publish([(p.seq, p.record) for p in rows], self.settings.connect_timeout_s)
        except Fenced as exc:
            # Another producer initialised the shard's transactional id. If the lease is still ours
            # (a relay whose lease ran out, before its heartbeat told it), a new producer of ours
            # fences it in turn (see _open); if not, the shard is given up.
            log.warning("outbox shard %d of group %r: another relay's producer took over (%s)", shard, self.group,
                        exc)
            self.metrics.relay_fenced()
            self._drop_publisher(shard)
            state.blocked_until = time.monotonic() + FENCED_RETRY_S
            return False
        except PublishFailed as exc:
            self._drop_publisher(shard)
            if exc.seq is not None:
                state.blocked_until = time.monotonic() + BLOCKED_RETRY_S
                state.blocked_on = exc.seq
                # Said every time (every BLOCKED_RETRY_S), not once: an operator must act on it.
                log.error("outbox shard %d of group %r stopped on row %d: Kafka refused it (%s); the rows wait, "
                          "nothing is skipped (tried again in %gs)", shard, self.group, exc.seq, exc, BLOCKED_RETRY_S)
                return False
            self._failed(f"publish shard {shard}", exc)
            return False
        state.published = rows[-1].seq
        state.blocked_on = None
        self._delay, self.last_error = RETRY_DELAY_S, None
        self.metrics.published(len(rows), rows[0].created_at)
        if not self.outbox.mark_published(shard, state.epoch, self.member, state.published):
            # Published (Kafka's progress holds it); the lease moved meanwhile: the next owner reads it there.
            log.warning("outbox shard %d of group %r was taken by another relay after publishing up to %d",
                        shard, self.group, state.published)
            self._forget(shard)
        return True

    def _open(self, shard: int, state: _Shard) -> None:
        """A new producer for the shard (fencing any earlier one), and its progress read from Kafka.

        Only while the lease is this relay's: a relay that lost it and does not know yet would
        otherwise fence the new holder's producer, and the two would take turns."""
        if not self.outbox.holds(self.member, shard, state.epoch):
            log.warning("outbox shard %d of group %r was taken by another relay: no longer publishing it",
                        shard, self.group)
            self._forget(shard)
            raise _LostShard()
        publisher = ShardPublisher(self.settings, self.group, shard, self.settings.outbox_max_record_bytes,
                                   self.database_id)
        try:
            if self._admin is None:
                self._admin = open_progress_reader(self.settings)
            in_kafka = publisher.progress(self._admin)
        except BaseException:
            publisher.close()
            raise
        marked = self.outbox.published_mark(shard)
        state.publisher, state.published = publisher, max(in_kafka, marked)
        if state.published > marked:
            # Published before, not marked (the last owner stopped in between): clean up now.
            self.outbox.mark_published(shard, state.epoch, self.member, state.published)
        log.info("outbox shard %d of group %r: published up to %d (Kafka's record), publishing on", shard,
                 self.group, state.published)

    # -- helpers ----------------------------------------------------------------

    def _idle(self, seconds: float) -> None:
        """Wait for a wake-up (this worker's commit, a NOTIFY from another's) or ``seconds``."""
        if self._wake.is_set():
            self._wake.clear()
            return
        if self._listener is None and self.outbox.postgresql:
            try:
                self._listener = Listener(self.outbox.engine)
            except SQLAlchemyError as exc:
                log.debug("LISTEN failed (polling instead): %s", exc)
        if self._listener is not None:
            deadline = time.monotonic() + seconds
            while not self._wake.is_set() and (left := deadline - time.monotonic()) > 0:
                try:
                    if self._listener.wait(min(left, 0.05)):
                        break
                except Exception as exc:
                    log.debug("the LISTEN connection failed (polling instead): %s", exc)
                    self._listener.close()
                    self._listener = None
                    self._wake.wait(left)
                    break
        else:
            self._wake.wait(seconds)
        self._wake.clear()

    def _wait_s(self) -> float:
        until_heartbeat = max(0.0, self._next_heartbeat - time.monotonic())
        until_retry = max(0.0, self._not_before - time.monotonic())
        return min(self.settings.outbox_poll_interval_s, until_heartbeat, max(until_retry, 0.001))

    def _failed(self, what: str, exc: BaseException) -> None:
        """Wait before trying again (doubling up to RETRY_MAX_DELAY_S); said once per distinct reason."""
        self._not_before = time.monotonic() + self._delay
        self._say(f"outbox relay of group {self.group!r} could not {what}: {first_line(exc)}; "
                  f"the rows wait (retrying in {self._delay:.1f}s)", logging.WARNING)
        self._delay = min(self._delay * 2, RETRY_MAX_DELAY_S)

    def _say(self, text: str, level: int) -> None:
        if text != self.last_error:
            log.log(level, text)
        self.last_error = text

    def _drop_publisher(self, shard: int) -> None:
        state = self._held.get(shard)
        if state is not None and state.publisher is not None:
            state.publisher.close()
            state.publisher = None

    def _forget(self, shard: int) -> None:
        self._drop_publisher(shard)
        self._held.pop(shard, None)

    def _release_all(self) -> None:
        for shard in list(self._held):
            epoch = self._held[shard].epoch
            self._forget(shard)
            try:
                self.outbox.release(self.member, shard, epoch)
            except SQLAlchemyError as exc:
                log.debug("releasing shard %d failed (its lease runs out): %s", shard, exc)
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

