"""The outbox's tables, the rows read from them, and the one cheap reading of every outbox's backlog.

Four tables (migrations 0007, 0010 and 0012), named with the settings' prefix inside their schema:
the rows waiting (``outbox``: one per record, keyed by group, shard and ``seq``), the shards
(``outbox_shards``: each one's ``next_seq``, incarnation and ``wake_seq``), the leases and published
marks (``outbox_relays``: a row per shard; a lane's lease is in the row of its number) and the live
relays (``outbox_members``). Nothing here writes: the statements live with what they do
(:mod:`kstore.relay.store` and the modules it is made of).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    func,
    select,
)

from kstore.db.writes import aware
from kstore.types import Produced

#: The outbox's columns a batch writes, in the order of its rows.
WRITE_COLUMNS = ("consumer_group", "shard", "seq", "topic", "partition_id", "key", "value", "headers", "created_at")

#: The PostgreSQL channel a transaction that took a shard's ``wake_seq`` notifies when it commits
#: (payload: its group).
CHANNEL = "kstore_outbox"


@dataclass(frozen=True)
class OutboxTables:
    outbox: Table
    shards: Table
    relays: Table
    members: Table


def build_tables(prefix: str = "kstore_", schema: str | None = None) -> OutboxTables:
    """The outbox's tables (migrations 0007, 0010 and 0012), named with ``prefix`` inside ``schema``."""
    md = MetaData(schema=schema)
    return OutboxTables(
        Table(
            f"{prefix}outbox", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("shard", Integer, primary_key=True),
            Column("seq", BigInteger, primary_key=True, autoincrement=False),
            Column("topic", String(255), nullable=False),
            Column("partition_id", Integer, nullable=True),
            Column("key", LargeBinary, nullable=True),
            Column("value", LargeBinary, nullable=True),
            Column("headers", Text, nullable=True),
            Column("created_at", DateTime(timezone=True), nullable=False),
        ),
        Table(
            f"{prefix}outbox_shards", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("shard", Integer, primary_key=True, autoincrement=False),
            Column("next_seq", BigInteger, nullable=False),
            Column("incarnation", String(32), nullable=False),
            # The seq its idle relay waits for (migration 0010): the transaction that takes it NOTIFYs.
            Column("wake_seq", BigInteger, nullable=True),
        ),
        Table(
            f"{prefix}outbox_relays", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("shard", Integer, primary_key=True, autoincrement=False),
            Column("owner", String(255), nullable=True),
            Column("epoch", BigInteger, nullable=False),
            Column("lease_expires", Float, nullable=False),
            Column("published_seq", BigInteger, nullable=False),
            Column("updated_at", DateTime(timezone=True), nullable=False),
            # The last row Kafka refused in the shard (migration 0012): for the operator, never read to publish.
            Column("refused_seq", BigInteger, nullable=True),
            Column("refused_at", DateTime(timezone=True), nullable=True),
            Column("refused_reason", Text, nullable=True),
        ),
        Table(
            f"{prefix}outbox_members", md,
            Column("consumer_group", String(255), primary_key=True),
            Column("member", String(255), primary_key=True),
            Column("seen_until", Float, nullable=False),
        ),
    )


def encode_headers(headers: Sequence[tuple[str, bytes | None]]) -> str | None:
    if not headers:
        return None
    return json.dumps([[n, None if v is None else base64.b64encode(v).decode()] for n, v in headers])


def decode_headers(text: str | None) -> tuple[tuple[str, bytes | None], ...]:
    if not text:
        return ()
    return tuple((n, None if v is None else base64.b64decode(v)) for n, v in json.loads(text))


class Pending(NamedTuple):
    """An outbox row waiting to be published (a tuple: a relay reads thousands at a time)."""

    shard: int
    seq: int
    record: Produced
    #: When its batch wrote it (just before its commit), in UTC.
    created_at: datetime


@dataclass(frozen=True)
class ShardState:
    """One shard as ``kstore outbox show`` and the metrics see it."""

    shard: int
    next_seq: int
    published_seq: int
    waiting: int
    oldest: datetime | None
    #: The relay holding the shard's lane, the lane's epoch and lease.
    owner: str | None
    epoch: int
    lease_left_s: float
    lane: int = 0
    #: The last row Kafka refused in the shard: see :class:`Refusal` (None: none yet).
    refused: Refusal | None = None


@dataclass(frozen=True)
class Refusal:
    """The last row of a shard Kafka refused: its seq, when, and Kafka's answer (no record contents)."""

    seq: int
    at: datetime
    reason: str


@dataclass(frozen=True)
class Backlog:
    """One outbox's records committed and not yet marked published (:func:`backlogs`): what the metrics,
    the console and ``kstore top`` say of every outbox alike."""

    #: The outbox's name: a group's (its processor's ``produce()``) or an application's (``Outbox(name)``).
    name: str
    waiting: int
    #: When the oldest of them was written (just before its transaction's commit), in UTC; None if none waits.
    oldest: datetime | None

    def age_s(self, at: datetime) -> float:
        """How long the oldest has waited at ``at``; 0 if none waits."""
        return 0.0 if self.oldest is None else max(0.0, (at - self.oldest).total_seconds())


def backlogs(conn: Connection, tables: OutboxTables, name: str | None = None) -> list[Backlog]:
    """Every outbox's backlog (or ``name``'s alone), by name, in one statement.

    Cheap however many rows wait: the rows are never counted nor scanned. A shard's count is its
    ``next_seq`` less its published mark (both move in the transactions that write and delete its
    rows, so they agree with the rows in any one snapshot), and its oldest row is its lowest ``seq``,
    one probe of the rows' primary key (group, shard, seq) per shard: the two small tables of shards
    are read whole, the rows' table once per shard."""
    s, r, o = tables.shards, tables.relays, tables.outbox
    first = (select(o.c.created_at).where(o.c.consumer_group == s.c.consumer_group, o.c.shard == s.c.shard)
             .order_by(o.c.seq).limit(1).correlate(s).scalar_subquery())
    shards = (select(s.c.consumer_group.label("name"), (s.c.next_seq - 1 - r.c.published_seq).label("waiting"),
                     first.label("oldest"))
              .join_from(s, r, and_(r.c.consumer_group == s.c.consumer_group, r.c.shard == s.c.shard)))
    if name is not None:
        shards = shards.where(s.c.consumer_group == name)
    per_shard = shards.subquery()
    rows = conn.execute(select(per_shard.c.name, func.sum(per_shard.c.waiting), func.min(per_shard.c.oldest))
                        .group_by(per_shard.c.name).order_by(per_shard.c.name)).all()
    return [Backlog(str(n), max(0, int(waiting or 0)), None if oldest is None else aware(oldest))
            for n, waiting, oldest in rows]


def groups_with_outbox(conn: Connection, tables: OutboxTables) -> Iterable[str]:
    return [row[0] for row in conn.execute(select(tables.shards.c.consumer_group).distinct())]
