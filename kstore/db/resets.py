"""Moving partitions' stored offsets: the statements behind ``kstore offsets set`` and every reset.

A move reads each row under its lock, decides the new offset from what is stored
*then*, writes it with an epoch bump (the owner notices and adopts it) and records
it in the history, all in one transaction. Deciding inside the lock is what makes a
relative move (``--shift-by``) safe against a live pipeline: a worker that advanced
the partition since the operator looked is shifted from where it really is, never
moved back to a stale position.

Every move carries a request id (in its history rows), so that a COMMIT whose answer
was lost can be looked up: see :mod:`kstore.db.indoubt`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Connection, Engine, Table, select, tuple_

from kstore.errors import FencedError
from kstore.types import TopicPartition

from . import indoubt
from .writes import WRITES, actor, now


class OffsetTables(Protocol):
    """What a move needs of a :class:`~kstore.db.store.Store`: its engine and its two tables.

    A protocol rather than the class: the store's own :meth:`~kstore.db.store.Store.reset` is a
    move, so this module sits below :mod:`kstore.db.store` and never imports it.
    """

    @property
    def engine(self) -> Engine: ...
    @property
    def offsets(self) -> Table: ...
    @property
    def history(self) -> Table: ...


#: The new offset of a partition, given its stored offset as read under the row's lock
#: (None: nothing stored). Raising refuses the whole move: nothing is written.
Decide = Callable[[TopicPartition, int | None], int]


@dataclass(frozen=True)
class Moved:
    """One partition's move as written: from the offset stored at the time, to the new one, at a new epoch."""

    topic: str
    partition: int
    from_offset: int | None
    to_offset: int
    epoch: int
    request_id: str


def move(store: OffsetTables, group: str, partitions: Iterable[TopicPartition], decide: Decide, *, reason: str,
         expected_epochs: Mapping[TopicPartition, int] | None = None) -> list[Moved]:
    """Move ``group``'s partitions in one transaction, each to ``decide(tp, stored)``; returns what was written.

    With ``expected_epochs`` a partition only moves if it is still held at that
    epoch (else :class:`FencedError`); without, an admin move always wins and
    creates missing rows. If the COMMIT's answer is lost, the history is read
    back by request id: landed returns as usual, not landed re-raises the
    COMMIT's error (running the move again is safe: it decides from the stored
    rows again), and unreadable raises :class:`CommitInDoubtError`.
    """
    request_id = uuid.uuid4().hex
    keys = sorted(partitions)  # one lock order for every move, so two moves never deadlock each other
    fences = expected_epochs or {}
    names = ", ".join(f"{t}[{p}]" for t, p in keys)
    with store.engine.connect() as conn:
        # On SQLite, BEGIN IMMEDIATE: a transaction that reads before it writes could
        # not wait for a worker's batch to commit ("database is locked" at once).
        conn.execution_options(**WRITES).begin()
        moved = [_move_one(store, conn, group, tp, decide, fences.get(tp), reason, request_id) for tp in keys]
        indoubt.commit(conn, lambda: _landed(store, group, keys, request_id),
                       what=f"reset {request_id} of {names} in group {group!r}",
                       check=f"`kstore offsets history --group {group}` for request id {request_id}")
    return moved


def _move_one(store: OffsetTables, conn: Connection, group: str, tp: TopicPartition, decide: Decide,
              expected_epoch: int | None, reason: str, request_id: str) -> Moved:
    o = store.offsets
    where = [o.c.consumer_group == group, o.c.topic == tp[0], o.c.partition_id == tp[1]]
    if expected_epoch is not None:
        where.append(o.c.epoch == expected_epoch)
    row = conn.execute(select(o.c.next_offset).where(*where).with_for_update()).first()
    if row is None and expected_epoch is not None:
        raise FencedError(f"{tp[0]}[{tp[1]}] of group {group!r} is no longer held at epoch {expected_epoch}")
    stored = None if row is None else row.next_offset
    to_offset = decide(tp, stored)
    if row is None:
        conn.execute(o.insert().values(consumer_group=group, topic=tp[0], partition_id=tp[1],
                                       next_offset=to_offset, epoch=1, updated_at=now()))
        epoch = 1
    else:
        epoch = int(conn.execute(
            o.update().where(*where).values(next_offset=to_offset, epoch=o.c.epoch + 1, updated_at=now())
            .returning(o.c.epoch)
        ).scalar_one())
    record(conn, store.history, group, tp, stored, to_offset, epoch, reason, request_id=request_id)
    return Moved(tp[0], tp[1], stored, to_offset, epoch, request_id)


def _landed(store: OffsetTables, group: str, keys: list[TopicPartition], request_id: str) -> bool:
    """On a fresh connection: is the move ``request_id`` in the history? (After its COMMIT's answer was lost.)"""
    o, h = store.offsets, store.history
    with store.engine.connect() as conn:
        conn.execution_options(**WRITES).begin()
        indoubt.wait_for_locks(conn)
        # The lost transaction holds these rows' locks until it ends: wait for its outcome.
        conn.execute(select(o.c.epoch).where(
            o.c.consumer_group == group, tuple_(o.c.topic, o.c.partition_id).in_(keys),
        ).with_for_update()).all()
        return conn.execute(select(h.c.id).where(h.c.request_id == request_id).limit(1)).first() is not None


def record(conn: Connection, history: Table, group: str, tp: TopicPartition, from_offset: int | None,
           to_offset: int | None, epoch: int, reason: str, *, request_id: str | None = None) -> None:
    """Add a row to the reset history in ``conn``'s transaction: who moved ``tp``, when, from where to where, why."""
    user, host = actor()
    conn.execute(history.insert().values(
        consumer_group=group, topic=tp[0], partition_id=tp[1], from_offset=from_offset,
        to_offset=to_offset, epoch=epoch, at=now(), by_user=user, by_host=host, reason=reason,
        request_id=request_id,
    ))
