"""Publishing one lane: its producer opened (fencing any earlier one) once it has rows, its progress
read back from Kafka, a transaction at a time of its rows in ``seq`` order with the lane's progress
mark, and the database's "published" mark written behind it.

Nothing here skips a row. A row Kafka refuses stops its shard (the reason logged, then tried again
after a wait that doubles from :data:`~kstore.relay.lane.BLOCKED_RETRY_FIRST_S` to
:data:`~kstore.relay.lane.BLOCKED_RETRY_S`); a broker or database outage leaves the rows waiting,
retried with a backoff; a transaction whose outcome is unknown is settled by a new producer
(``init_transactions``) and the progress read again from Kafka. Each held lane runs
:meth:`LanePublishing._lane_loop` on a thread of its own, which owns the lane's producer and state.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from sqlalchemy.exc import SQLAlchemyError

from kstore.db.sqlerrors import first_line
from kstore.errors import BrokerError, BrokerNotReadyError, OutboxChangedError
from kstore.kafka.seam import Fenced, PublishFailed

from .base import RelayBase
from .lane import (
    BLOCKED_RETRY_FIRST_S,
    BLOCKED_RETRY_S,
    BUSY_RECHECK_S,
    FENCED_RETRY_S,
    MARK_INTERVAL_S,
    MAX_ROWS_PER_TRANSACTION,
    NOT_READY_ROUTINE_S,
    RETRY_DELAY_S,
    RETRY_MAX_DELAY_S,
    Lane,
    LostLane,
    close_publisher,
)
from .progress import PROGRESS_TOPIC_CONFIG, progress_topic
from .publisher import LanePublisher
from .tables import Pending

log = logging.getLogger(__name__)


class LanePublishing(RelayBase):
    """The publishing of each lane a relay holds, on the lane's own thread."""

    def _lane_loop(self, state: Lane) -> None:
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
            close_publisher(state)

    def _lane_wait_s(self, state: Lane) -> float:
        """Until the lane's retry is due; else until its mark is due or the next poll."""
        now = time.monotonic()
        if state.not_before > now:
            return state.not_before - now
        wait = self.settings.outbox_poll_interval_s
        if state.unmarked:
            wait = min(wait, state.marked_at + MARK_INTERVAL_S - now)
        return max(0.001, wait)

    def _step(self, state: Lane) -> bool:
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
        except LostLane:
            return False
        except SQLAlchemyError as exc:
            self._lane_failed(state, "read or mark it", exc)
        except BrokerError as exc:
            close_publisher(state)
            self._lane_failed(state, "open its producer", exc)
        return False

    def _rows_waiting(self, state: Lane) -> tuple[dict[int, int], str] | None:
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

    def _check_incarnation(self, state: Lane, incarnation: str) -> None:
        """The shards were made anew (``kstore outbox reshard``) since this relay read their count: its
        lanes are the old count's, so it stops (the lane is given up, and :attr:`error` ends the relay:
        started again, it reads the new shards)."""
        if self.outbox.incarnation in (None, incarnation):
            return
        self.error = OutboxChangedError(
            f"the outbox of {self.group!r} was resharded while this relay ran (it shares the lanes of "
            f"{self.outbox.shards} shard(s)): it stops; start it again")
        state.lost = True
        raise LostLane()

    def _ask_for_a_wakeup(self, state: Lane, published: dict[int, int]) -> Literal["sleep", "publish", "busy"]:
        """:meth:`Outbox.sleep_until_written` for the lane's shards; a writer holding one of them
        (``"busy"``) has the lane look again after BUSY_RECHECK_S (or at its NOTIFY, if it takes the
        seq asked for)."""
        answer = self.outbox.sleep_until_written(published)
        if answer == "busy":
            state.not_before = time.monotonic() + BUSY_RECHECK_S
        return answer

    def _publish(self, state: Lane) -> bool:
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
            close_publisher(state)
            state.not_before = time.monotonic() + FENCED_RETRY_S
            return False
        except PublishFailed as exc:
            close_publisher(state)
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

    def _sleep_until_written(self, state: Lane) -> bool:
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

    def _mark(self, state: Lane, due: bool) -> None:
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
            raise LostLane()
        state.marked.update(unmarked)
        state.marked_at = now

    def _open(self, state: Lane, marked: dict[int, int], incarnation: str) -> None:
        """A new producer for the lane (fencing any earlier one), and its progress read from Kafka
        (``marked``: the database's marks of its shards, read with their ``incarnation``).

        Only while the lease is this relay's: a relay that lost it and does not know yet would
        otherwise fence the new holder's producer, and the two would take turns."""
        if not self.outbox.holds(self.member, state.lane, state.epoch):
            log.warning("outbox %s of group %r was taken by another relay: no longer publishing it",
                        state.name, self.group)
            state.lost = True
            raise LostLane()
        with self._admin_lock:
            self._ensure_progress_topic()
        publisher = LanePublisher(self._publisher_class, self.settings, self.group, state.lane, incarnation)
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

    def _lane_failed(self, state: Lane, what: str, exc: BaseException) -> None:
        """Wait before trying the lane again (doubling up to RETRY_MAX_DELAY_S). Said once per
        reason, whichever lane meets it first (an outage fails them all alike), until a lane
        publishes again."""
        state.not_before = time.monotonic() + state.delay
        reason = f"could not {what}: {first_line(exc)}"
        log.log(self._failure_level(state, reason, exc), "outbox %s of group %r: %s; the rows wait (retrying in "
                "%.1fs)", state.name, self.group, reason, state.delay)
        state.delay = min(state.delay * 2, RETRY_MAX_DELAY_S)

    def _failure_level(self, state: Lane, reason: str, exc: BaseException) -> int:
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
    def _routine(state: Lane, exc: BaseException) -> bool:
        """A "not now" from the brokers before the lane's first producer opened, for NOT_READY_ROUTINE_S."""
        if state.opened or not isinstance(exc, BrokerNotReadyError):
            return False
        now = time.monotonic()
        if state.not_ready_since is None:
            state.not_ready_since = now
        return now - state.not_ready_since < NOT_READY_ROUTINE_S

    def _ensure_progress_topic(self) -> None:
        """Make the group's progress topic (:func:`~kstore.relay.progress.progress_topic`) if the cluster has
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
