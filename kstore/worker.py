"""The run loop: claim partitions, take a batch, process it in one transaction
with its offsets, and handle fencing, resets and shutdown.

The worker is a plain object: ``run()``, ``request_stop()``, ``close()``. It
installs no signal handlers; the CLI wires signals to :meth:`request_stop`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from .consumer import TP, KafkaSource, Record, ms_to_datetime
from .errors import ConfigurationError, FencedError, InvalidOffsetError, KstoreError, ProcessorError
from .migration import check_migrated
from .processor import Message, Processor
from .settings import Settings, parse_start_policy
from .store import Claim, Store, make_engine
from .targets import Target, check_target, policy_offset

log = logging.getLogger(__name__)

#: First and longest wait before retrying a database that failed (claim or commit).
DB_RETRY_DELAY = 0.5
DB_RETRY_MAX_DELAY = 10.0


@dataclass
class _Owned:
    """A partition this worker holds: the epoch it claimed and the offset stored for it."""

    epoch: int
    committed: int


class _HandlerFailed(Exception):
    """The processor (or deserializing a message) raised; wraps the original."""


class Worker:
    """Runs one :class:`Processor` against Kafka and a database, exactly once."""

    def __init__(self, processor: Processor, settings: Settings | None = None) -> None:
        self.processor = processor
        self.settings = settings or Settings()
        group = self.settings.group or processor.group
        topics = list(self.settings.topics or processor.topics)
        if not group:
            raise ConfigurationError(f"{type(processor).__name__} has no group: set `group = ...` or --group")
        if not topics:
            raise ConfigurationError(f"{type(processor).__name__} has no topics: set `topics = [...]` or --topic")
        self.group: str = group
        self.topics = topics
        self._policy = parse_start_policy(self.settings.start_from)
        self._stop = threading.Event()
        self._owned: dict[TP, _Owned] = {}
        self._pending: set[TP] = set()
        self._db_delay = DB_RETRY_DELAY
        self._claim_retry_at = 0.0
        self._store: Store | None = None
        self._source: KafkaSource | None = None

    # -- lifecycle ----------------------------------------------------------

    def connect(self) -> None:
        """Check the database (reachable, migrated) and the brokers; idempotent."""
        if self._source is not None:
            return
        engine = make_engine(self.settings)
        store = Store(engine, self.settings)
        try:
            store.check_reachable()
            check_migrated(engine, self.settings)
        except KstoreError:
            engine.dispose()
            raise
        try:
            source = KafkaSource(self.settings, self.group, self.topics)
        except KstoreError:
            engine.dispose()
            raise
        try:
            source.check_topics()
        except KstoreError:
            source.close()
            engine.dispose()
            raise
        self._store = store
        self._source = source

    def run(self, max_batches: int | None = None, idle_timeout: float | None = None) -> None:
        """Process until :meth:`request_stop` (or a bound for tests and scripts is reached).

        ``max_batches``: stop after that many committed batches. ``idle_timeout``:
        stop once partitions are held and no record arrived for that many seconds.
        """
        self.connect()
        source = self._src
        log.info("worker for group %r on %s: database %s, brokers %s", self.group,
                 ", ".join(self.topics), self.settings.safe_dsn, self.settings.bootstrap_servers)
        self.processor.engine = self._db.engine
        self.processor.setup()
        try:
            source.subscribe()
            self._loop(max_batches, idle_timeout)
        finally:
            self.close()

    def _loop(self, max_batches: int | None, idle_timeout: float | None) -> None:
        source = self._src
        batches = 0
        last_activity = time.monotonic()
        while not self._stop.is_set():
            # Poll without waiting while work is queued, so processing never stalls on
            # the network; skip fetching more while a full poll's worth is still queued.
            queued = source.queued()
            if queued < self.settings.max_poll_records:
                source.poll(0 if queued else self.settings.poll_timeout_ms)
            self._apply_events()
            self._claim_pending()
            if self._process_next():
                batches += 1
                last_activity = time.monotonic()
                if max_batches is not None and batches >= max_batches:
                    return
            elif self._pending or not self._owned:
                last_activity = time.monotonic()
            elif idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                return

    def request_stop(self) -> None:
        """Finish the batch in flight, commit it, leave the group. Safe from any thread or signal handler."""
        self._stop.set()

    def close(self) -> None:
        """Call the processor's teardown, leave the group and close the database pool."""
        source, self._source = self._source, None
        if source is None:
            return
        try:
            self.processor.teardown()
        finally:
            with source.lock:
                self._owned.clear()
            source.close()
            if self._store is not None:
                self._store.engine.dispose()
            log.info("worker for group %r stopped", self.group)

    @property
    def _src(self) -> KafkaSource:
        if self._source is None:
            raise KstoreError("worker is not connected: call run() or connect() first")
        return self._source

    @property
    def _db(self) -> Store:
        if self._store is None:
            raise KstoreError("worker is not connected: call run() or connect() first")
        return self._store

    # -- partition ownership --------------------------------------------------

    def _apply_events(self) -> None:
        """Act on the rebalance events the listener recorded during ``poll()``, in order."""
        for kind, tps in self._src.take_events():
            if kind == "assigned":
                self._pending.update(tps)
                log.info("assigned %s; claiming before any delivery", _fmt(tps))
            else:
                self._pending.difference_update(tps)
                self._drop(tps, kind)

    def _drop(self, tps: Iterable[TP], why: str, pause: bool = False) -> None:
        with self._src.lock:
            dropped = [tp for tp in tps if self._owned.pop(tp, None) is not None]
            self._src.disown(tps, pause=pause)
        if dropped:
            log.info("%s %s", why, _fmt(dropped))
            self.processor.on_revoked(dropped)

    def _claim_pending(self) -> None:
        """Claim newly assigned partitions, seek them to their stored offsets, resume them.

        If the database fails, the partitions stay paused and the claim is
        retried with backoff: kstore never falls back to Kafka's own offsets.
        """
        if not self._pending or time.monotonic() < self._claim_retry_at:
            return
        source = self._src
        self._pending &= source.assignment()
        tps = sorted(self._pending)
        if not tps:
            return
        try:
            claims = self._db.claim(self.group, tps)
            with source.lock:
                starts = self._start_offsets(claims)
                for tp in tps:
                    self._take_ownership(tp, claims[tp], starts[tp])
        except SQLAlchemyError as exc:
            self._claim_retry_at = time.monotonic() + self._db_backoff(f"claim {_fmt(tps)}", exc)
            return
        self._db_delay = DB_RETRY_DELAY
        self._pending.difference_update(tps)
        log.info("claimed %s", ", ".join(f"{t}[{p}]@{self._owned[(t, p)].committed}" for t, p in tps))
        self.processor.on_assigned(tps)

    def _start_offsets(self, claims: Mapping[TP, Claim]) -> dict[TP, tuple[int, str | None]]:
        """Where each claimed partition starts, and why if that is not its stored offset."""
        targets: dict[TP, Target | None] = {tp: c.next_offset for tp, c in claims.items()}
        return self._resolve(targets, strict=False)

    def _take_ownership(self, tp: TP, claim: Claim, start: tuple[int, str | None]) -> None:
        offset, why = start
        epoch = claim.epoch
        if why is not None:
            # Persist where we start, so a restart before the first commit resumes
            # at the same offset (a "latest" resolved again later would skip records).
            epoch = self._db.reset(self.group, tp, offset, expected_epoch=epoch, reason=why)
        self._owned[tp] = _Owned(epoch, offset)
        self._src.own(tp, offset)

    # -- resets ---------------------------------------------------------------

    def reset_offsets(
        self,
        pairs: Mapping[TP, Target] | Iterable[tuple[TP, Target]],
        *,
        strict: bool | None = None,
        reason: str = "reset_offsets",
    ) -> dict[TP, int]:
        """Move partitions this worker holds to new positions; returns where each went.

        ``pairs``: ``((topic, partition_id), target)`` with a target an int
        offset, a ``datetime``, ``EARLIEST`` or ``LATEST``. Under the partition
        lock, the new position is stored (bumping the epoch, recorded in the
        history), the queued messages are flushed and the consumer seeks, so no
        message fetched before the reset is delivered after it. An invalid
        target logs an error and falls back to ``start_from``; with
        ``strict=True`` (or ``Settings.strict_resets``) it raises
        :class:`InvalidOffsetError` and nothing moves.
        """
        targets = dict(pairs.items() if isinstance(pairs, Mapping) else pairs)
        strict = self.settings.strict_resets if strict is None else strict
        source = self._src
        with source.lock:
            foreign = [tp for tp in targets if tp not in self._owned]
            if foreign:
                raise KstoreError(
                    f"this worker does not hold {_fmt(foreign)}; move others with `kstore offsets set`"
                )
            resolved = self._resolve(dict(targets), strict=strict)
            for tp, (offset, why) in resolved.items():
                note = reason if why is None else f"{reason}: {why}"
                epoch = self._db.reset(self.group, tp, offset, expected_epoch=self._owned[tp].epoch, reason=note)
                self._owned[tp] = _Owned(epoch, offset)
                source.own(tp, offset)
                log.info("reset %s[%d] to %d (%s)", tp[0], tp[1], offset, note)
        return {tp: offset for tp, (offset, _why) in resolved.items()}

    @property
    def held_offsets(self) -> dict[TP, int]:
        """``{(topic, partition_id): next_offset}`` for the partitions this worker holds now."""
        source = self._source
        if source is None:
            return {}
        with source.lock:
            return {tp: owned.committed for tp, owned in self._owned.items()}

    def _resolve(self, targets: Mapping[TP, Target | None], strict: bool) -> dict[TP, tuple[int, str | None]]:
        """Check targets against the logs; an invalid or missing one gets the start policy.

        Returns ``{tp: (offset, why)}`` where ``why`` is None if the target was
        used as given, else the reason the policy was applied.
        """
        source = self._src
        bounds = source.log_bounds(list(targets))
        times = {tp: t for tp, t in targets.items() if isinstance(t, datetime)}
        if isinstance(self._policy, datetime):
            times.update({tp: self._policy for tp, t in targets.items() if t is None or not isinstance(t, datetime)})
        found = source.offsets_for_times(times) if times else {}
        out: dict[TP, tuple[int, str | None]] = {}
        for tp, target in targets.items():
            problem = "no stored offset"
            if target is not None:
                offset, problem_or_none = check_target(target, bounds[tp], found.get(tp))
                if offset is not None:
                    out[tp] = (offset, None)
                    continue
                problem = problem_or_none or "invalid target"
                if strict:
                    raise InvalidOffsetError(f"{tp[0]}[{tp[1]}]: {problem}")
                log.error("%s[%d]: %s; using start_from=%s instead", tp[0], tp[1], problem, self.settings.start_from)
            policy_time = found.get(tp) if isinstance(self._policy, datetime) else None
            offset = policy_offset(self._policy, bounds[tp], policy_time)
            out[tp] = (offset, f"{problem}: start_from={self.settings.start_from}")
        return out

    # -- processing -----------------------------------------------------------

    def _process_next(self) -> bool:
        """Take one batch and process it; True if a batch committed."""
        source = self._src
        with source.lock:
            batch = source.take_batch(self.settings.max_batch_size)
            if not batch:
                return False
            tps = {r.tp for r in batch}
            generations = {tp: source.generation(tp) or 0 for tp in tps}
            epochs = {tp: self._owned[tp].epoch for tp in tps}
        positions: dict[TP, tuple[int, int]] = {}
        for r in batch:  # records of a partition are in offset order
            positions[r.tp] = (r.offset + 1, epochs[r.tp])
        try:
            fenced = self._transact(batch, positions)
        except _HandlerFailed as exc:
            source.requeue(batch, generations)
            cause = exc.__cause__ or exc
            if isinstance(cause, OperationalError):
                self._stop.wait(self._db_backoff("process a batch", cause))
                return False
            first = batch[0]
            raise ProcessorError(
                f"processor {type(self.processor).__name__} failed on {first.topic}[{first.partition}] "
                f"at offset {first.offset} (batch of {len(batch)}): {type(cause).__name__}: {cause}; "
                "nothing of the batch was committed"
            ) from cause
        except SQLAlchemyError as exc:
            source.requeue(batch, generations)
            self._stop.wait(self._db_backoff("commit a batch", exc))
            return False
        self._db_delay = DB_RETRY_DELAY
        if fenced:
            self._on_fenced(fenced, epochs)
            source.requeue(batch, generations)
            return False
        with source.lock:
            for tp, (nxt, epoch) in positions.items():
                owned = self._owned.get(tp)
                if owned is not None and owned.epoch == epoch:
                    owned.committed = nxt
        if log.isEnabledFor(logging.DEBUG):
            log.debug("committed %d messages: %s", len(batch), ", ".join(
                f"{t}[{p}]->{nxt}@{epoch}" for (t, p), (nxt, epoch) in sorted(positions.items())))
        return True

    def _transact(self, batch: Sequence[Record], positions: Mapping[TP, tuple[int, int]]) -> set[TP]:
        """One transaction: the processor's writes, then the offsets ``WHERE epoch = ours``.

        Returns the fenced partitions (the transaction was rolled back) or an empty set (committed).
        """
        store = self._db
        with store.engine.connect() as conn:
            trans = conn.begin()
            # rollback_only: a session.commit() by the processor flushes but
            # cannot commit the transaction that the offsets must share.
            session = Session(bind=conn, join_transaction_mode="rollback_only")
            try:
                try:
                    self.processor.session = session
                    self.processor.handle_batch([self._message(r) for r in batch])
                    session.flush()
                except Exception as exc:
                    raise _HandlerFailed(str(exc)) from exc
                # Last statement before COMMIT: the row locks are held as briefly as possible.
                fenced = store.commit_offsets(conn, self.group, positions)
                if fenced:
                    trans.rollback()
                    return fenced
                trans.commit()
                return set()
            finally:
                session.close()
                if trans.is_active:
                    trans.rollback()

    def _message(self, r: Record) -> Message:
        key, value = self.processor.deserialize(r.key, r.value)
        return Message(r.topic, r.partition, r.offset, key, value, r.headers, ms_to_datetime(r.timestamp_ms))

    def _on_fenced(self, fenced: set[TP], epochs: Mapping[TP, int]) -> None:
        """Some rows no longer carry our epoch: roll back (done), stop delivering those partitions.

        A partition whose epoch moved because this worker reset it meanwhile is
        still ours (the reset already flushed and sought it). Any other was
        claimed by another worker or reset by an admin: pause it and forget it;
        the rest of the batch is retried under the same epochs.
        """
        with self._src.lock:
            lost = [tp for tp in fenced if tp in self._owned and self._owned[tp].epoch == epochs[tp]]
        if lost:
            log.warning("fenced on %s: another worker or an admin took them; rolled back", _fmt(lost))
            self._drop(lost, "fenced", pause=True)

    def _db_backoff(self, what: str, exc: BaseException) -> float:
        delay = self._db_delay
        self._db_delay = min(self._db_delay * 2, DB_RETRY_MAX_DELAY)
        orig = getattr(exc, "orig", None) or exc
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        log.warning("database error, could not %s: %s; retrying in %.1fs", what, first, delay)
        return delay


def _fmt(tps: Iterable[TP]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in sorted(tps)) or "nothing"


def load_processor(path: str) -> Processor:
    """Import ``MODULE:CLASS`` and instantiate it; a clear error if it is not a Processor."""
    import importlib

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"processor must be MODULE:CLASS, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import processor module {module_name!r}: {exc}") from None
    cls: Any = getattr(module, attr, None)
    if cls is None:
        raise ConfigurationError(f"module {module_name!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise ConfigurationError(f"{path} is not a kstore.Processor subclass")
    instance: Processor = cls()
    return instance


__all__ = ["FencedError", "Worker", "load_processor"]
