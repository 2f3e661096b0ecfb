"""The simulated pipeline: one effect row per message (no unique key, so a duplicate
shows as two rows), poison messages that always raise, and the delivery checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from sqlalchemy import Column, Integer, LargeBinary, MetaData, String, Table

from kstore import Message, Processor, RetryPolicy

from .invariants import Delivery, StoredRow, check_delivery

if TYPE_CHECKING:
    from .world import Member

TP = tuple[str, int]
GROUP = "sim"
POISON = b"poison"

effects = Table(
    "sim_effects", MetaData(),
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("topic", String), Column("partition_id", Integer), Column("kafka_offset", Integer),
    Column("value", LargeBinary), Column("worker", String), Column("epoch", Integer),
)

_ROWS = "SELECT topic, partition_id, next_offset, epoch, owner FROM kstore_offsets WHERE consumer_group = ?"


class PoisonError(Exception):
    """What the processor raises for a poison message, every time."""


class SimProcessor(Processor):
    group: ClassVar[str | None] = GROUP
    topics: ClassVar[Sequence[str]] = ("t",)
    retry: ClassVar[RetryPolicy] = RetryPolicy(max_attempts=2, backoff_s=0.0, jitter=0.0)
    on_error = "dead_letter"

    #: Set by the world before the worker starts.
    member: Member

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self._check(msgs)
        member = self.member
        for msg in msgs:
            if msg.value is not None and msg.value.startswith(POISON):
                member.world.poison_tried((msg.topic, msg.partition), msg.offset, alone=len(msgs) == 1)
                raise PoisonError(f"poison at {msg.topic}[{msg.partition}] offset {msg.offset}")
            self.session.execute(effects.insert(), {
                "topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset,
                "value": msg.value, "worker": member.name, "epoch": member.taken.get((msg.topic, msg.partition)),
            })

    def _check(self, msgs: Sequence[Message]) -> None:
        member = self.member
        # Read in the batch's own transaction, on its DBAPI connection (a SQLAlchemy
        # statement per batch cost a sixth of the simulation's time).
        dbapi = self.session.connection().connection.dbapi_connection
        assert dbapi is not None
        rows = {(t, p): StoredRow(n, e, o) for t, p, n, e, o in dbapi.execute(_ROWS, (GROUP,))}
        by_tp: dict[TP, Delivery] = {}
        for msg in msgs:
            d = by_tp.setdefault((msg.topic, msg.partition), Delivery((msg.topic, msg.partition), [], []))
            d.offsets.append(msg.offset)
            d.values.append(msg.value)
        world = member.world
        stale_ok = "late_read_back" in world.cfg.tolerate and member.name in world.db.landed_late
        for delivery in by_tp.values():
            if check_delivery(member.worker.worker_id, member.taken, rows, delivery, world.cluster.value,
                              world.journal, stale_ok):
                world.db.fired["lost_answer/late: batch re-run below the stored offset"] += 1
        world.delivered += len(msgs)
