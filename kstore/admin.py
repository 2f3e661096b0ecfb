"""Offset administration: see where a pipeline stands and move it, from code or `kstore offsets`.

The same names as the CLI: ``kstore offsets show`` is :func:`show_offsets`,
``kstore offsets set`` is :func:`set_offsets`, ``kstore offsets history`` is
:func:`offset_history`. A reset bumps the partition's epoch and keeps its owner:
a running worker notices within ``epoch_check_interval_s``, flushes what it had
queued, seeks to the new position and carries on, and anything it was processing
under the old epoch is rolled back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from .consumer import TP, KafkaInspector
from .errors import ConfigurationError, InvalidOffsetError
from .migration import check_migrated
from .settings import Settings
from .store import HistoryEntry, Store, make_engine
from .targets import EARLIEST, LATEST, Target, check_target


@dataclass(frozen=True)
class PartitionStatus:
    """Where one partition of a pipeline stands."""

    topic: str
    partition: int
    next_offset: int | None
    log_start: int
    log_end: int
    #: Records not yet processed: log end minus next offset (from the log start if none is stored).
    lag: int
    epoch: int | None
    updated_at: datetime | None
    #: The live member of the Kafka group assigned the partition (``client_id@host``), or None.
    owner: str | None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["updated_at"] = self.updated_at.isoformat() if self.updated_at else None
        return d


@dataclass(frozen=True)
class PlannedReset:
    """One partition's move: from where, to where, and a note (e.g. clamped)."""

    topic: str
    partition: int
    from_offset: int | None
    to_offset: int
    note: str = ""


@contextmanager
def _connections(settings: Settings) -> Iterator[tuple[Store, KafkaInspector]]:
    engine = make_engine(settings)
    try:
        store = Store(engine, settings)
        store.check_reachable()
        check_migrated(engine, settings)
        kafka = KafkaInspector(settings)
        try:
            yield store, kafka
        finally:
            kafka.close()
    finally:
        engine.dispose()


def show_offsets(settings: Settings, group: str, topic: str | None = None) -> list[PartitionStatus]:
    """Stored offset, log bounds, lag, epoch, last update and live owner of each partition of a group."""
    with _connections(settings) as (store, kafka):
        rows = store.rows(group, topic)
        topics = [topic] if topic else sorted({t for t, _ in rows})
        tps = [(t, p) for t in topics for p in kafka.partitions(t)]
        bounds = kafka.log_bounds(tps)
        owners = kafka.live_owners(group)
    out = []
    for tp in tps:
        row = rows.get(tp)
        start, end = bounds[tp]
        nxt = row.next_offset if row else None
        out.append(PartitionStatus(
            topic=tp[0], partition=tp[1], next_offset=nxt, log_start=start, log_end=end,
            lag=max(0, end - (nxt if nxt is not None else start)), epoch=row.epoch if row else None,
            updated_at=row.updated_at if row else None, owner=owners.get(tp),
        ))
    return out


def set_offsets(
    settings: Settings,
    group: str,
    topic: str,
    partitions: Sequence[int] | None = None,
    *,
    to_offset: int | None = None,
    to_datetime: datetime | None = None,
    to_earliest: bool = False,
    to_latest: bool = False,
    shift_by: int | None = None,
    clamp: bool = False,
    reason: str | None = None,
    execute: bool = False,
) -> list[PlannedReset]:
    """Plan (and with ``execute=True`` apply) a reset of a group's partitions on one topic.

    Exactly one target: ``to_offset``, ``to_datetime`` (the first record at or
    after it), ``to_earliest``, ``to_latest`` or ``shift_by`` (from the stored
    offset). Every target is checked against the partition's log: one outside it
    raises :class:`InvalidOffsetError` and nothing changes, unless ``clamp``
    moves it to the nearest end. Without ``execute`` nothing is written.
    """
    given = [to_offset is not None, to_datetime is not None, to_earliest, to_latest, shift_by is not None]
    if sum(given) != 1:
        raise ConfigurationError(
            "give exactly one of --to-offset, --to-datetime, --to-earliest, --to-latest, --shift-by"
        )
    with _connections(settings) as (store, kafka):
        known = kafka.partitions(topic)
        chosen = list(partitions) if partitions else known
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise ConfigurationError(f"topic {topic!r} has no partition {', '.join(map(str, unknown))}")
        tps = [(topic, p) for p in chosen]
        rows = store.rows(group, topic)
        bounds = kafka.log_bounds(tps)
        times = kafka.offsets_for_times({tp: to_datetime for tp in tps}) if to_datetime else {}
        plan = [_plan_one(tp, rows[tp].next_offset if tp in rows else None, bounds[tp], times.get(tp), clamp,
                          to_offset=to_offset, to_datetime=to_datetime, to_earliest=to_earliest, shift_by=shift_by)
                for tp in tps]
        refused = [item.note for item in plan if item.note.startswith("refused")]
        if refused:
            raise InvalidOffsetError(
                "; ".join(refused) + " (nothing changed; --clamp moves targets to the nearest end)"
            )
        if execute:
            why = f"kstore offsets set: {reason}" if reason else "kstore offsets set"
            for item in plan:
                store.reset(group, (item.topic, item.partition), item.to_offset, expected_epoch=None, reason=why)
    return plan


def _plan_one(tp: TP, current: int | None, bounds: tuple[int, int], time_offset: int | None, clamp: bool, *,
              to_offset: int | None, to_datetime: datetime | None, to_earliest: bool, shift_by: int | None,
              ) -> PlannedReset:
    target: Target
    if shift_by is not None:
        if current is None:
            return PlannedReset(*tp, current, -1, f"refused: {tp[0]}[{tp[1]}] has no stored offset to shift")
        target = current + shift_by
    elif to_offset is not None:
        target = to_offset
    elif to_datetime is not None:
        target = to_datetime
    else:
        target = EARLIEST if to_earliest else LATEST
    offset, problem = check_target(target, bounds, time_offset)
    if offset is not None:
        return PlannedReset(*tp, current, offset)
    if not clamp:
        return PlannedReset(*tp, current, -1, f"refused: {tp[0]}[{tp[1]}]: {problem}")
    start, end = bounds
    near = start if isinstance(target, int) and target < start else end
    return PlannedReset(*tp, current, near, f"clamped ({problem})")


def offset_history(settings: Settings, group: str, topic: str | None = None, limit: int = 50) -> list[HistoryEntry]:
    """The most recent resets of a group (by the CLI, by code, or by the start policy), newest first."""
    engine = make_engine(settings)
    try:
        store = Store(engine, settings)
        store.check_reachable()
        check_migrated(engine, settings)
        return store.history_entries(group, topic, limit)
    finally:
        engine.dispose()
