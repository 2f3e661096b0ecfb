"""Offset administration: see where a pipeline stands and move it, from code or `kstore offsets`.

The same names as the CLI: ``kstore offsets show`` is :func:`show_offsets`,
``kstore offsets set`` is :func:`set_offsets`, ``kstore offsets history`` is
:func:`offset_history`. A reset bumps the partition's epoch and keeps its owner:
a running worker notices within ``epoch_check_interval_s``, flushes what it had
queued, seeks to the new position and carries on, and anything it was processing
under the old epoch is rolled back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any, Literal

from sqlalchemy.exc import SQLAlchemyError

from kstore.db.migration import check_migrated
from kstore.db.resets import move
from kstore.db.sqlerrors import first_line
from kstore.db.store import HistoryEntry, Store, make_engine
from kstore.errors import BrokerError, ConfigurationError, DatabaseError, InvalidOffsetError
from kstore.kafka.clients import admin_reader
from kstore.kafka.seam import MIRROR_METADATA, AdminReader
from kstore.settings import Settings
from kstore.targets import EARLIEST, LATEST, Target, check_target
from kstore.types import TopicPartition as TP


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
    #: The live member of the Kafka group assigned the partition: its client id, a kstore worker's
    #: name as in its logs and the stored rows' owner (unless ``client_id`` is set), or None.
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
    #: Once applied, for a group that mirrors its offsets to Kafka (``mirror_offsets``): what became
    #: of its committed offset there, ``moved``, ``left to live workers`` (they mirror it) or
    #: ``not moved: <why>``. Empty when the group does not mirror, or nothing was applied.
    mirror: str = ""


#: What :func:`mirror_move` did: the group does not mirror (nothing to do), its committed offsets in
#: Kafka moved, or they are left to its live members (which mirror them).
MirrorMove = Literal["not mirrored", "moved", "left to live workers"]


@contextmanager
def _connections(settings: Settings) -> Iterator[tuple[Store, AdminReader]]:
    engine = make_engine(settings)
    try:
        store = Store(engine, settings)
        store.check_reachable()
        check_migrated(engine, settings)
        kafka = admin_reader(settings)
        try:
            kafka.connect()
            yield store, kafka
        finally:
            kafka.close()
    finally:
        engine.dispose()


def _partitions(kafka: AdminReader, settings: Settings, topic: str) -> list[int]:
    found = kafka.partitions(topic)
    if not found:
        raise ConfigurationError(f"unknown topic {topic!r} at {settings.bootstrap_servers}")
    return found


def show_offsets(settings: Settings, group: str, topic: str | None = None) -> list[PartitionStatus]:
    """Stored offset, log bounds, lag, epoch, last update and live owner of each partition of a group.

    A group with no stored offset at all (a typo, most likely) raises :class:`ConfigurationError`
    naming the groups that have some.
    """
    with _connections(settings) as (store, kafka):
        rows = store.rows(group, topic)
        if not rows:
            _check_known(store, group)
        topics = [topic] if topic else sorted({t for t, _ in rows})
        tps = [(t, p) for t in topics for p in _partitions(kafka, settings, t)]
        bounds = kafka.log_bounds(tps)
        owners = kafka.group_view(group).owners(store.registered_members(group))
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


#: How many of the groups with stored offsets an unknown group's error names.
_GROUPS_LISTED = 20


def check_group_known(settings: Settings, group: str) -> None:
    """Raise :class:`ConfigurationError` if ``group`` has no stored offset in the database (see
    :func:`_check_known`): ``kstore top`` asks it before its first frame."""
    engine = make_engine(settings)
    try:
        store = Store(engine, settings)
        store.check_reachable()
        check_migrated(engine, settings)
        try:
            _check_known(store, group)
        except SQLAlchemyError as exc:
            raise DatabaseError(f"database {settings.safe_dsn}: {first_line(exc)}") from None
    finally:
        engine.dispose()


def _check_known(store: Store, group: str) -> None:
    """A group with no stored offset at all is most likely a typo: say so, naming the groups that have some."""
    groups = store.groups()
    if group in groups:
        return
    if groups:
        listed = ", ".join(groups[:_GROUPS_LISTED])
        more = f" and {len(groups) - _GROUPS_LISTED} more" if len(groups) > _GROUPS_LISTED else ""
        others = f"groups that have some: {listed}{more}"
    else:
        others = "no group has any yet"
    raise ConfigurationError(f"group {group!r} has no stored offsets in {store.settings.safe_dsn} (a worker stores "
                             f"a partition's offset when it first claims it); {others}")


@dataclass(frozen=True)
class ResetRequest:
    """What an operator asks for: exactly one target, and whether to clamp it into the log."""

    to_offset: int | None = None
    to_datetime: datetime | None = None
    to_earliest: bool = False
    to_latest: bool = False
    shift_by: int | None = None
    clamp: bool = False

    def __post_init__(self) -> None:
        given = [self.to_offset is not None, self.to_datetime is not None, self.to_earliest, self.to_latest,
                 self.shift_by is not None]
        if sum(given) != 1:
            raise ConfigurationError(
                "give exactly one of --to-offset, --to-datetime, --to-earliest, --to-latest, --shift-by"
            )


@dataclass(frozen=True)
class _Plan:
    """A reset worked out against the partitions' logs; the stored offsets are read again when it is applied."""

    group: str
    request: ResetRequest
    #: The partitions to move, with their log bounds.
    bounds: dict[TP, tuple[int, int]]
    times: dict[TP, int | None]

    def one(self, tp: TP, stored: int | None) -> PlannedReset:
        return _plan_one(tp, stored, self.bounds[tp], self.times.get(tp), self.request)


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
    via: str = "kstore offsets set",
) -> list[PlannedReset]:
    """Plan (and with ``execute=True`` apply) a reset of a group's partitions on one topic.

    Exactly one target: ``to_offset``, ``to_datetime`` (the first record at or
    after it), ``to_earliest``, ``to_latest`` or ``shift_by`` (from the stored
    offset). Every target is checked against the partition's log: one outside it
    raises :class:`InvalidOffsetError` and nothing changes, unless ``clamp``
    moves it to the nearest end. Without ``execute`` nothing is written.

    With ``execute`` all partitions move in one transaction, each decided from
    its offset as stored at that moment (under the row's lock), so a shift is
    relative to where a running worker really is; the result says what was
    written. Where the group mirrors its offsets to Kafka (``mirror_offsets``) and
    no worker of it is live, its committed offsets there move too
    (:attr:`PlannedReset.mirror` says how it went; a failure there leaves the move
    in place). If the database's answer to the COMMIT is lost, the reset is looked
    up again: landed returns as usual, not landed raises :class:`DatabaseError`
    (running it again is safe), and unknown raises :class:`CommitInDoubtError`.

    ``reason`` is required with ``execute``: the reset history is what an operator
    reads later to learn why messages were skipped or processed again, and the
    why is the one thing only the person resetting knows (``kstore dead-letters
    discard`` and ``resolve`` require one for the same reason). It is recorded as ``"<via>: <reason>"``.
    """
    request = ResetRequest(to_offset, to_datetime, to_earliest, to_latest, shift_by, clamp)
    if execute and not (reason or "").strip():
        raise ConfigurationError("give a reason for the reset (--reason); it is recorded in the reset history")
    with _connections(settings) as (store, kafka):
        plan, items = _plan(store, kafka, group, topic, _partitions(kafka, settings, topic), partitions, request)
        if not execute:
            return items
        applied = _apply(store, plan, f"{via}: {reason}")
        return _mirror(kafka, settings, group, applied)


def _plan(store: Store, kafka: AdminReader, group: str, topic: str, known: list[int],
          partitions: Sequence[int] | None, request: ResetRequest) -> tuple[_Plan, list[PlannedReset]]:
    """The plan, and what it does to the offsets stored now (a refusal raises here already)."""
    chosen = list(partitions) if partitions else known
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise ConfigurationError(f"topic {topic!r} has no partition {', '.join(map(str, unknown))}")
    tps = [(topic, p) for p in chosen]
    rows = store.rows(group, topic)
    bounds = kafka.log_bounds(tps)
    times = kafka.offsets_for_times({tp: request.to_datetime for tp in tps}) if request.to_datetime else {}
    plan = _Plan(group, request, bounds, dict(times))
    items = [plan.one(tp, rows[tp].next_offset if tp in rows else None) for tp in tps]
    _refuse(items)
    return plan, items


def _apply(store: Store, plan: _Plan, reason: str) -> list[PlannedReset]:
    def target(tp: TP, stored: int | None) -> int:
        # Decided again from the offset stored now, under the row's lock: a worker
        # may have moved it since the plan was made.
        item = plan.one(tp, stored)
        _refuse([item])  # raised inside the transaction: nothing of the reset is written
        return item.to_offset

    try:
        moved = move(store, plan.group, list(plan.bounds), target, reason=reason)
    except SQLAlchemyError as exc:
        raise DatabaseError(
            f"the reset of group {plan.group!r} did not land ({first_line(exc)}): nothing changed; "
            "it is safe to run it again"
        ) from None
    # What was written: FROM as stored under the lock, TO (and its note) decided from it.
    return [replace(plan.one((m.topic, m.partition), m.from_offset), to_offset=m.to_offset) for m in moved]


def _mirror(kafka: AdminReader, settings: Settings, group: str, applied: list[PlannedReset]) -> list[PlannedReset]:
    """The move landed in the database; a group that mirrors its offsets to Kafka gets them there too,
    or lag tools would show the old ones (hiding a replay) until a worker commits again."""
    try:
        done: str = mirror_move(kafka, group, {(p.topic, p.partition): p.to_offset for p in applied},
                                mirrors=settings.mirror_offsets)
    except BrokerError as exc:
        done = f"not moved: {exc}"  # the move itself stands: only the lag tools' copy is behind
    if done == "not mirrored":
        return applied
    return [replace(p, mirror=done) for p in applied]


def mirror_move(kafka: AdminReader, group: str, offsets: Mapping[TP, int], *, mirrors: bool = False) -> MirrorMove:
    """After an operator's move of ``group`` in the database: where the group mirrors its offsets to
    Kafka (``mirrors``, or the metadata of its committed offsets there says so), write the new ones
    there too, unless a live member owns a partition of the group: its worker mirrors them itself
    once it has followed the move (and Kafka takes no offsets but its members' then). kstore never
    reads these offsets: they only keep Kafka's lag tools right. Raises BrokerError if the brokers refuse
    (a member that joined since the look: it mirrors them itself).
    """
    committed = kafka.committed(group)
    if not mirrors and not any(c.metadata == MIRROR_METADATA for c in committed.values()):
        return "not mirrored"
    if kafka.group_view(group).owners():
        return "left to live workers"
    kafka.commit(group, offsets, MIRROR_METADATA)
    return "moved"


def _refuse(plan: list[PlannedReset]) -> None:
    refused = [item.note for item in plan if item.note.startswith("refused")]
    if refused:
        raise InvalidOffsetError("; ".join(refused) + " (nothing changed; --clamp moves targets to the nearest end)")


def _plan_one(tp: TP, current: int | None, bounds: tuple[int, int], time_offset: int | None,
              request: ResetRequest) -> PlannedReset:
    target: Target
    if request.shift_by is not None:
        if current is None:
            return PlannedReset(*tp, current, -1, f"refused: {tp[0]}[{tp[1]}] has no stored offset to shift")
        target = current + request.shift_by
    elif request.to_offset is not None:
        target = request.to_offset
    elif request.to_datetime is not None:
        target = request.to_datetime
    else:
        target = EARLIEST if request.to_earliest else LATEST
    offset, problem = check_target(target, bounds, time_offset)
    if offset is not None:
        return PlannedReset(*tp, current, offset)
    if not request.clamp:
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
