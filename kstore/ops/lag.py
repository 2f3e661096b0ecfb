"""Where a group stands, in messages and in seconds, read from the database and the brokers.

No worker is needed: the stored offsets come from ``kstore_offsets``, the log
bounds and live owners from the brokers, and the age of the oldest message not
yet committed from the record at the stored offset itself, fetched by a consumer
that is assigned the partition (no group) and reads one record (:meth:`kstore.kafka.seam.AdminReader.first_timestamps`).
That timestamp is
cached per (topic, partition, offset), so a steady scrape of a partition whose
offset has not moved asks the brokers only for the log bounds.

Used by ``kstore exporter`` and ``kstore top``; :class:`LagReader` keeps its
connections between readings and opens them again after an outage. With ``outbox=True`` (``kstore
top``) a reading also holds the group's outbox shards, read in the same visit to the database; with
``applications=True`` (``kstore top``) the backlog of every outbox no group with stored offsets has
too (an application's: :class:`kstore.outbox.Outbox`). :meth:`LagReader.read_outboxes` reads every
outbox's backlog (``kstore exporter``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, null, select, union_all
from sqlalchemy.exc import SQLAlchemyError

from kstore.db import deadletters
from kstore.db.migration import check_migrated
from kstore.db.sqlerrors import first_line
from kstore.db.store import Row, Store, make_engine
from kstore.errors import BrokerError, DatabaseError
from kstore.kafka.clients import admin_reader
from kstore.relay.store import Outbox
from kstore.relay.tables import Backlog, ShardState
from kstore.settings import Settings
from kstore.telemetry.metrics import PartitionLag
from kstore.types import TopicPartition as TP

from .outbox import list_outboxes

log = logging.getLogger(__name__)

#: A reading should answer well within a Prometheus scrape timeout (10 s by default), so a broker
#: that stops answering fails it instead of holding it for a client's default 30 s (and a "not now"
#: from the brokers is not asked again within the reading: the next scrape asks). A
#: ``request_timeout_ms`` Kafka option given to kafka-python wins.
REQUEST_TIMEOUT_MS = 5000
#: How long one reading waits for the records whose timestamps it needs.
FETCH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PartitionReading:
    """One partition of a group, as read now."""

    topic: str
    partition: int
    #: The stored next offset (None: no row yet; the lag then counts from the log start).
    stored_offset: int | None
    log_start: int
    log_end: int
    #: Log end minus the next offset to process.
    lag_messages: int
    #: Age of the record at the next offset to process; 0 when caught up, None when unknown.
    lag_seconds: float | None
    epoch: int | None
    #: The live member of the Kafka group assigned the partition, or None (read only with ``owners=True``).
    owner: str | None
    #: Dead letters of this partition not yet replayed.
    dead_letters: int
    #: When its stored row last changed (a commit, a claim or a reset); None without a row.
    updated_at: datetime | None = None

    @property
    def lag(self) -> PartitionLag:
        return PartitionLag(self.topic, self.partition, self.lag_messages, self.lag_seconds)


@dataclass(frozen=True)
class GroupReading:
    """Every partition of a group's topics (the topics it has stored offsets for)."""

    group: str
    #: When it was read (``time.time()``).
    at: float
    partitions: list[PartitionReading]
    #: All the group's dead letters not yet replayed (also those of topics it no longer reads).
    dead_letters: int
    #: The group's outbox shards (read only with ``outbox=True``; none if the group has no outbox).
    outbox: list[ShardState] = field(default_factory=list)
    #: The backlog of every outbox that is no group's with stored offsets: applications' (read only with
    #: ``applications=True``).
    applications: list[Backlog] = field(default_factory=list)


class LagReader:
    """Reads groups' lag; one per process, not thread-safe (callers take a lock)."""

    def __init__(self, settings: Settings, *, owners: bool = False, outbox: bool = False, applications: bool = False,
                 fetch_timeout_s: float = FETCH_TIMEOUT_S, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        # A mistake in the Kafka settings (TLS files, a token provider) is named now, not at the first reading.
        timeout_ms = settings.kafka_options.get("request_timeout_ms", REQUEST_TIMEOUT_MS)
        self._kafka = admin_reader(settings, request_timeout_s=timeout_ms / 1000, patience_s=0)
        self.owners, self.outbox, self.fetch_timeout_s, self.clock = owners, outbox, fetch_timeout_s, clock
        self.applications = applications
        self.engine = make_engine(self.settings)
        self.store = Store(self.engine, self.settings)
        self.dead_letters = deadletters.build_table(self.settings.table_prefix, self.settings.schema)
        self._migrated = False
        #: (topic, partition) -> (offset, its record's timestamp in ms, or None if it has none)
        self._stamp_cache: dict[TP, tuple[int, int | None]] = {}

    def read(self, group: str) -> GroupReading:
        """The group now. Raises :class:`DatabaseError` or :class:`BrokerError` (the next call reconnects)."""
        rows, dead, shards, applications = self._read_database(group)
        reading = self._from_brokers(group, rows, dead, shards, self.owners)
        return replace(reading, applications=applications)

    def read_outboxes(self) -> list[Backlog]:
        """Every outbox's backlog in the database, by name. Raises :class:`DatabaseError` (the next call
        reconnects)."""
        with self._database():
            self._check_migrated()
            return list_outboxes(self.engine, self.settings)

    def read_all(self) -> tuple[list[GroupReading], dict[str, BrokerError]]:
        """Every group with a stored offset now, without owners or outbox: the readings, and the
        brokers' error for each group they could not answer for. The database is asked once for
        all of them (one statement), so a reading of many groups costs it no more than one group's.
        Raises :class:`DatabaseError` (the next call reconnects)."""
        found, failed = [], {}
        for group, (rows, dead) in self._read_all_databases().items():
            try:
                found.append(self._from_brokers(group, rows, dead, [], owners=False))
            except BrokerError as exc:
                failed[group] = exc
        return found, failed

    def _from_brokers(self, group: str, rows: Mapping[TP, Row], dead: Mapping[TP, int], shards: list[ShardState],
                      owners: bool) -> GroupReading:
        try:
            return self._read_brokers(group, rows, dead, shards, owners)
        except BrokerError:  # every error of the brokers' (kstore.kafka.seam.AdminReader)
            self._close_kafka()
            raise

    def close(self) -> None:
        self._close_kafka()
        self.engine.dispose()

    def reset(self) -> None:
        """Drop every connection (after an unexpected error): the next reading opens them again."""
        self.close()
        self._migrated = False

    # -- the database --------------------------------------------------------------------------

    def _read_database(self, group: str) -> tuple[dict[TP, Row], dict[TP, int], list[ShardState], list[Backlog]]:
        with self._database():
            self._check_migrated()
            rows = self.store.rows(group)
            stmt = self._waiting_letters().where(self.dead_letters.c.consumer_group == group)
            with self.engine.connect() as conn:
                dead = {(topic, p): n for _group, topic, p, n in conn.execute(stmt)}
            outbox = Outbox(self.engine, group, self.settings.table_prefix, self.settings.schema)
            shards = outbox.state() if self.outbox else []
            applications = self._applications() if self.applications else []
        return rows, dead, shards, applications

    def _applications(self) -> list[Backlog]:
        """The outboxes no group with stored offsets has (kstore's tables cannot tell an application's
        outbox from a group's otherwise)."""
        groups = set(self.store.groups())
        return [b for b in list_outboxes(self.engine, self.settings) if b.name not in groups]

    def _read_all_databases(self) -> dict[str, tuple[dict[TP, Row], dict[TP, int]]]:
        """Every group with a stored offset: its rows and its dead letters waiting by partition, both
        from one statement (a UNION ALL of the offsets and the letters' counts)."""
        o = self.store.offsets
        stored = select(o.c.consumer_group, o.c.topic, o.c.partition_id, null().label("dead"), o.c.next_offset,
                        o.c.epoch, o.c.owner, o.c.updated_at)
        waiting = self._waiting_letters().add_columns(null(), null(), null(), null())
        groups: dict[str, tuple[dict[TP, Row], dict[TP, int]]] = {}
        letters: list[tuple[str, TP, int]] = []
        with self._database():
            self._check_migrated()
            with self.engine.connect() as conn:
                for group, topic, partition, dead, next_offset, epoch, owner, updated_at in conn.execute(
                        union_all(stored, waiting)):
                    if dead is None:
                        groups.setdefault(group, ({}, {}))[0][(topic, partition)] = Row(next_offset, epoch, owner,
                                                                                          updated_at)
                    else:
                        letters.append((group, (topic, partition), dead))
        for group, tp, dead in letters:
            if group in groups:  # a group's letters without a stored offset: not a group that is read
                groups[group][1][tp] = dead
        return dict(sorted(groups.items()))

    def _waiting_letters(self) -> Select[Any]:
        """Dead letters waiting, counted by group and partition: ``(group, topic, partition, count)``."""
        t = self.dead_letters
        return (select(t.c.consumer_group, t.c.topic, t.c.partition_id, func.count())
                .where(t.c.status == deadletters.DEAD)
                .group_by(t.c.consumer_group, t.c.topic, t.c.partition_id))

    @contextlib.contextmanager
    def _database(self) -> Iterator[None]:
        """A visit to the database: its errors as :class:`DatabaseError`, and after one the pooled
        connections (which may be dead) dropped and the migrations checked again, so the next
        reading starts afresh."""
        try:
            yield
        except SQLAlchemyError as exc:
            self.engine.dispose()
            raise DatabaseError(f"database {self.settings.safe_dsn}: {first_line(exc)}") from None
        except DatabaseError:
            self._migrated = False
            raise

    def _check_migrated(self) -> None:
        if not self._migrated:
            check_migrated(self.engine, self.settings)
            self._migrated = True

    # -- the brokers ---------------------------------------------------------------------------

    def _read_brokers(self, group: str, rows: Mapping[TP, Row], dead: Mapping[TP, int],
                      shards: list[ShardState], with_owners: bool) -> GroupReading:
        tps = [(topic, p) for topic in sorted({t for t, _ in rows}) for p in self._kafka.partitions(topic)]
        bounds = self._kafka.log_bounds(tps)
        owners = self._kafka.group_view(group).owners(self.store.registered_members(group)) if with_owners else {}
        nexts = {tp: _next_offset(rows.get(tp), bounds[tp][0]) for tp in tps}
        # Below the log start (retention deleted records meanwhile), the oldest record there is the oldest waiting.
        waiting = {tp: max(nexts[tp], bounds[tp][0]) for tp in tps if nexts[tp] < bounds[tp][1]}
        stamps = self._oldest_timestamps(waiting)
        now = self.clock()
        out = []
        for tp in tps:
            row = rows.get(tp)
            start, end = bounds[tp]
            behind = max(0, end - nexts[tp])
            out.append(PartitionReading(
                topic=tp[0], partition=tp[1], stored_offset=row.next_offset if row else None,
                log_start=start, log_end=end, lag_messages=behind,
                lag_seconds=_age(now, stamps.get(tp)) if behind else 0.0,
                epoch=row.epoch if row else None, owner=owners.get(tp), dead_letters=dead.get(tp, 0),
                updated_at=row.updated_at if row else None,
            ))
        return GroupReading(group, now, out, sum(dead.values()), shards)

    def _oldest_timestamps(self, wanted: Mapping[TP, int]) -> dict[TP, int]:
        """The timestamp (ms) of the record at each partition's next offset, from the cache or the brokers."""
        for tp in set(self._stamp_cache) - set(wanted):
            del self._stamp_cache[tp]  # caught up (or gone): its offset's timestamp is no longer needed
        missing = {tp: offset for tp, offset in wanted.items() if self._stamp_cache.get(tp, (None,))[0] != offset}
        if missing:
            for tp, stamp in self._fetch_timestamps(missing).items():
                self._stamp_cache[tp] = (missing[tp], stamp)
        return {tp: stamp for tp, (_, stamp) in self._stamp_cache.items() if stamp is not None}

    def _fetch_timestamps(self, offsets: Mapping[TP, int]) -> dict[TP, int | None]:
        """One record of each partition, from its offset on: its timestamp (None: the record has none).

        A partition whose record did not arrive within ``fetch_timeout_s`` is left out (asked again next time).
        """
        return self._kafka.first_timestamps(offsets, self.fetch_timeout_s)

    def _close_kafka(self) -> None:
        self._kafka.close()
        self._stamp_cache.clear()


def _next_offset(row: Row | None, log_start: int) -> int:
    """The next offset to process: the stored one, or the log start without one (as `kstore offsets show`)."""
    return log_start if row is None or row.next_offset is None else row.next_offset


def _age(now: float, stamp_ms: int | None) -> float | None:
    if stamp_ms is None:
        return None
    return max(0.0, now - stamp_ms / 1000)
