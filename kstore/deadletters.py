"""Dead letters: writing them (inside the batch's transaction), listing, showing and replaying them.

A replay runs the message through the processor in a transaction that also marks
the dead letter ``replayed`` (``WHERE status = 'dead'``, checked to touch exactly
one row), so a dead letter's effect lands exactly once even if two operators
replay it at the same time.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    select,
)

from . import indoubt
from .consumer import Record, ms_to_datetime
from .errors import CommitInDoubtError, KstoreError
from .migration import check_migrated
from .processor import Message, Processor, run_handler, to_ms
from .retry import Failure
from .settings import Settings
from .store import WRITES, make_engine, now

log = logging.getLogger(__name__)

DEAD = "dead"
REPLAYED = "replayed"


def build_table(prefix: str = "kstore_", schema: str | None = None) -> Table:
    return Table(
        f"{prefix}dead_letters",
        MetaData(schema=schema),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("consumer_group", String(255), nullable=False),
        Column("topic", String(255), nullable=False),
        Column("partition_id", Integer, nullable=False),
        Column("offset", BigInteger, nullable=False),
        Column("key", LargeBinary, nullable=True),
        Column("value", LargeBinary, nullable=True),
        Column("headers", Text, nullable=False),
        Column("timestamp", DateTime(timezone=True), nullable=True),
        Column("error", Text, nullable=False),
        Column("traceback", Text, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("first_failure_at", DateTime(timezone=True), nullable=False),
        Column("last_failure_at", DateTime(timezone=True), nullable=False),
        Column("status", String(16), nullable=False),
        Column("replayed_at", DateTime(timezone=True), nullable=True),
    )


@dataclass(frozen=True)
class DeadLetter:
    id: int
    consumer_group: str
    topic: str
    partition_id: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp: datetime | None
    error: str
    traceback: str
    attempts: int
    first_failure_at: datetime
    last_failure_at: datetime
    status: str
    replayed_at: datetime | None

    def summary(self) -> dict[str, Any]:
        """Everything but the raw bytes and the traceback, for listings."""
        return {
            "id": self.id, "group": self.consumer_group, "topic": self.topic, "partition": self.partition_id,
            "offset": self.offset, "error": self.error, "attempts": self.attempts, "status": self.status,
            "first_failure_at": self.first_failure_at.isoformat(), "last_failure_at": self.last_failure_at.isoformat(),
            "replayed_at": self.replayed_at.isoformat() if self.replayed_at else None,
        }


def _encode_headers(headers: Sequence[tuple[str, bytes | None]]) -> str:
    return json.dumps([[k, None if v is None else base64.b64encode(v).decode()] for k, v in headers])


def _decode_headers(raw: str) -> tuple[tuple[str, bytes | None], ...]:
    return tuple((k, None if v is None else base64.b64decode(v)) for k, v in json.loads(raw))


def write(conn: Connection, table: Table, group: str, record: Record, failure: Failure) -> None:
    """Insert a dead letter; the caller's transaction also moves the offset past the message."""
    conn.execute(table.insert().values(
        consumer_group=group, topic=record.topic, partition_id=record.partition, offset=record.offset,
        key=record.key, value=record.value, headers=_encode_headers(record.headers or ()),
        timestamp=ms_to_datetime(record.timestamp), error=failure.error, traceback=failure.traceback,
        attempts=failure.attempts, first_failure_at=failure.first_at, last_failure_at=failure.last_at,
        status=DEAD,
    ))


class DeadLetters:
    """Dead letters of one database."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self._own_engine = engine is None
        self.engine = engine or make_engine(settings)
        self.table = build_table(settings.table_prefix, settings.schema)
        if self._own_engine:
            check_migrated(self.engine, settings)

    def close(self) -> None:
        if self._own_engine:
            self.engine.dispose()

    def find(self, group: str, status: str | None = DEAD, limit: int = 100) -> list[DeadLetter]:
        t = self.table
        stmt = select(t).where(t.c.consumer_group == group).order_by(t.c.id).limit(limit)
        if status is not None:
            stmt = stmt.where(t.c.status == status)
        with self.engine.connect() as conn:
            return [_row(r) for r in conn.execute(stmt)]

    def get(self, dead_letter_id: int) -> DeadLetter:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.table).where(self.table.c.id == dead_letter_id)).first()
        if row is None:
            raise KstoreError(f"no dead letter with id {dead_letter_id}")
        return _row(row)

    def replay(self, processor: Processor, letter: DeadLetter) -> bool:
        """Run one dead letter through ``processor``; True if its effects and its 'replayed' mark committed.

        False if it was already replayed. Raises what the processor raises (nothing is committed then).
        If the COMMIT's answer is lost, the mark is read back: replayed, it landed (True); still dead,
        the COMMIT's error is raised (it may be replayed again); unreadable, :class:`CommitInDoubtError`.
        """
        t = self.table
        key, value = processor.deserialize(letter.key, letter.value)
        msg = Message(letter.topic, letter.partition_id, letter.offset, key, value, letter.headers,
                      to_ms(letter.timestamp))
        with self.engine.connect() as conn:  # closing it rolls back whatever did not commit
            # On SQLite, BEGIN IMMEDIATE: wait for a running worker's batch instead of failing.
            conn.execution_options(**WRITES).begin()
            run_handler(processor, conn, [msg])
            marked = conn.execute(
                t.update().where(t.c.id == letter.id, t.c.status == DEAD).values(status=REPLAYED, replayed_at=now())
            ).rowcount
            if marked != 1:  # replayed meanwhile by someone else: do not apply it twice
                return False
            # The mark and the effects commit together, so the mark read back tells whether both landed.
            indoubt.commit(
                conn, lambda: self._replayed(letter.id), what=f"the replay of dead letter {letter.id}",
                check=f"`kstore dead-letters show {letter.id}` (status replayed: it landed; dead: it did not)",
            )
            return True

    def _replayed(self, dead_letter_id: int) -> bool:
        """On a fresh connection: is the dead letter marked replayed? (After a replay's COMMIT answer was lost.)"""
        t = self.table
        with self.engine.connect() as conn:
            conn.execution_options(**WRITES).begin()
            indoubt.wait_for_locks(conn)
            status = conn.execute(select(t.c.status).where(t.c.id == dead_letter_id).with_for_update()).scalar()
        if status is None:
            raise KstoreError(f"dead letter {dead_letter_id} is gone")
        return bool(status == REPLAYED)

    def note_failure(self, letter: DeadLetter, exc: BaseException) -> None:
        t = self.table
        with self.engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == letter.id).values(
                attempts=t.c.attempts + 1, last_failure_at=now(), error=f"{type(exc).__name__}: {exc}"))


def _row(r: Any) -> DeadLetter:
    return DeadLetter(
        id=r.id, consumer_group=r.consumer_group, topic=r.topic, partition_id=r.partition_id, offset=r.offset,
        key=r.key, value=r.value, headers=_decode_headers(r.headers), timestamp=r.timestamp, error=r.error,
        traceback=r.traceback, attempts=r.attempts, first_failure_at=r.first_failure_at,
        last_failure_at=r.last_failure_at, status=r.status, replayed_at=r.replayed_at,
    )


@dataclass(frozen=True)
class ReplayResult:
    replayed: list[int]
    skipped: list[int]
    failed: dict[int, str]


def replay_dead_letters(settings: Settings, processor: Processor, group: str,
                        ids: Sequence[int] | None = None) -> ReplayResult:
    """Replay a group's dead letters (or the given ids) through ``processor``, each exactly once."""
    letters = DeadLetters(settings)
    try:
        processor.engine = letters.engine
        processor.setup()
        todo = [letters.get(i) for i in ids] if ids else letters.find(group)
        replayed: list[int] = []
        skipped: list[int] = []
        failed: dict[int, str] = {}
        for letter in todo:
            if letter.consumer_group != group or letter.status != DEAD:
                skipped.append(letter.id)
                continue
            try:
                (replayed if letters.replay(processor, letter) else skipped).append(letter.id)
            except CommitInDoubtError:
                raise  # not a failure to count: it may have landed; the operator must look first
            except Exception as exc:
                letters.note_failure(letter, exc)
                failed[letter.id] = f"{type(exc).__name__}: {exc}"
        processor.teardown()
        return ReplayResult(replayed, skipped, failed)
    finally:
        letters.close()
