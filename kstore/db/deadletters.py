"""Dead letters: writing them (inside the batch's transaction), listing, showing, marking them replayed, closing them.

A dead letter starts ``dead`` (waiting) and leaves that status once, for good:
``replayed`` (its message ran through the processor again, as written or with
an edited key or value), ``discarded`` (dropped on purpose) or ``resolved``
(fixed by hand elsewhere). Each change is one transaction that updates the
letter ``WHERE status = 'dead'`` (checked to touch exactly the rows it meant to)
and adds a row to ``kstore_dead_letter_history`` with who, when, why and a
request id; a replay's processor effects commit in that same transaction, so a
dead letter's effect lands exactly once even if two operators act on it at once.

A message that fails again while its letter waits (``dead``) updates that letter instead of
adding another one for the same message: the worker's write (after the offsets were moved back
over it) adds its attempts and takes its latest error, and so does a replay that fails (with a
history row, ``dead -> dead``). One waiting letter per message, so replaying them can never
apply a message twice. A replay holds its letter's row lock from its start (PostgreSQL: taken
with NOWAIT): a second replay, discard or resolve of that letter meanwhile is refused at once
with :class:`DeadLetterBusyError`, so two operators never both act on it.

If a change's COMMIT loses its answer, the request id is looked up on a fresh
connection (:mod:`kstore.db.indoubt`): found, it landed; not found, it did not;
unreadable, :class:`~kstore.errors.CommitInDoubtError`. Doing the same thing
twice is a no-op (an already discarded letter stays as it was discarded); a
different change of a letter that already left ``dead`` is refused with
:class:`DeadLetterStateError`.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
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
    func,
    select,
)
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from kstore.errors import ConfigurationError, DatabaseError, KstoreError
from kstore.retry import Failure
from kstore.settings import Settings
from kstore.types import Produced, Record, ms_to_datetime, timestamp_ms

from . import indoubt
from .migration import check_migrated
from .sqlerrors import first_line, sqlstate
from .store import build_tables, make_engine
from .writes import WRITES, actor, now

log = logging.getLogger(__name__)

DEAD = "dead"
REPLAYED = "replayed"
DISCARDED = "discarded"
RESOLVED = "resolved"
STATUSES = (DEAD, REPLAYED, DISCARDED, RESOLVED)
#: The action that leads to each final status, as the history and the messages name it.
ACTIONS = {REPLAYED: "replay", DISCARDED: "discard", RESOLVED: "resolve"}


class DeadLetterStateError(KstoreError):
    """The dead letter already left ``dead`` another way (e.g. replaying a discarded one), or is not the group's."""


class DeadLetterBusyError(DeadLetterStateError):
    """Another operator is replaying (or changing) the dead letter right now; nothing was done."""


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
        # The error it was dead-lettered with, once a failed replay put another in ``error`` (migration 0015).
        Column("first_error", Text, nullable=True),
    )


def build_history_table(prefix: str = "kstore_", schema: str | None = None) -> Table:
    """One row per status change of a dead letter (migration 0005)."""
    return Table(
        f"{prefix}dead_letter_history",
        MetaData(schema=schema),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("dead_letter_id", Integer, nullable=False),
        Column("consumer_group", String(255), nullable=False),
        Column("action", String(16), nullable=False),
        Column("from_status", String(16), nullable=False),
        Column("to_status", String(16), nullable=False),
        Column("at", DateTime(timezone=True), nullable=False),
        Column("by_user", String(255), nullable=False),
        Column("by_host", String(255), nullable=False),
        Column("reason", Text, nullable=True),
        Column("request_id", String(32), nullable=False),
        Column("edited", Boolean, nullable=False),
        Column("replayed_key", LargeBinary, nullable=True),
        Column("replayed_value", LargeBinary, nullable=True),
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
    #: The error it was dead-lettered with, when a failed replay's error has taken ``error``'s place.
    first_error: str | None = None

    def summary(self) -> dict[str, Any]:
        """Everything but the raw bytes and the traceback, for listings."""
        return {
            "id": self.id, "group": self.consumer_group, "topic": self.topic, "partition": self.partition_id,
            "offset": self.offset, "error": self.error,
            **({"first_error": self.first_error} if self.first_error is not None else {}),
            "attempts": self.attempts, "status": self.status,
            "first_failure_at": self.first_failure_at.isoformat(), "last_failure_at": self.last_failure_at.isoformat(),
            "replayed_at": self.replayed_at.isoformat() if self.replayed_at else None,
        }


@dataclass(frozen=True)
class Change:
    """One status change of a dead letter, from ``kstore_dead_letter_history``."""

    dead_letter_id: int
    action: str
    from_status: str
    to_status: str
    at: datetime
    by_user: str
    by_host: str
    reason: str | None
    request_id: str
    #: A replay that ran with an edited key or value: what the processor got (the original stays on the letter).
    edited: bool
    replayed_key: bytes | None
    replayed_value: bytes | None

    @property
    def by(self) -> str:
        return f"{self.by_user}@{self.by_host}"

    @property
    def failed(self) -> bool:
        """A replay that failed: the letter stayed dead (its error and attempts say how)."""
        return self.from_status == self.to_status == DEAD


@dataclass(frozen=True)
class Edit:
    """A replay's replacement key and/or value (raw bytes, before ``deserialize``); None keeps the original."""

    key: bytes | None = None
    value: bytes | None = None

    def __post_init__(self) -> None:
        if self.key is None and self.value is None:
            raise ConfigurationError("an edit needs a new key or a new value")

    def apply(self, letter: DeadLetter) -> tuple[bytes | None, bytes | None]:
        return (letter.key if self.key is None else self.key,
                letter.value if self.value is None else self.value)


@dataclass(frozen=True)
class StatusChange:
    """What a discard or resolve did: the letters it changed, those already in that status, and its request id."""

    status: str
    changed: list[int]
    already: list[int]
    #: None if nothing was written (every letter already had the status).
    request_id: str | None


def _encode_headers(headers: Sequence[tuple[str, bytes | None]]) -> str:
    return json.dumps([[k, None if v is None else base64.b64encode(v).decode()] for k, v in headers])


def _decode_headers(raw: str) -> tuple[tuple[str, bytes | None], ...]:
    return tuple((k, None if v is None else base64.b64decode(v)) for k, v in json.loads(raw))


def write(conn: Connection, table: Table, group: str, record: Record, failure: Failure) -> bool:
    """Dead-letter a message; the caller's transaction also moves the offset past it. True if a new
    letter was written.

    If the message already has a waiting letter (it was processed again after the offsets were
    moved back over it), that letter takes the new failure: its attempts are added, its error,
    traceback and last failure are the new ones. Otherwise a new letter is inserted.
    """
    t = table
    updated = conn.execute(t.update().where(
        t.c.consumer_group == group, t.c.topic == record.topic, t.c.partition_id == record.partition,
        t.c.offset == record.offset, t.c.status == DEAD,
    ).values(attempts=t.c.attempts + failure.attempts, error=failure.error, traceback=failure.traceback,
             last_failure_at=failure.last_at)).rowcount
    if updated:
        return False
    conn.execute(table.insert().values(
        consumer_group=group, topic=record.topic, partition_id=record.partition, offset=record.offset,
        key=record.key, value=record.value, headers=_encode_headers(record.headers or ()),
        timestamp=ms_to_datetime(timestamp_ms(record)), error=failure.error, traceback=failure.traceback,
        attempts=failure.attempts, first_failure_at=failure.first_at, last_failure_at=failure.last_at,
        status=DEAD,
    ))
    return True


#: The headers a dead-letter topic's record carries besides the original's: Spring Kafka's names and
#: encodings (its ``DeadLetterPublishingRecoverer``), which its tools and consumers read, and the
#: attempts as kstore counted them.
DLT_HEADERS = ("kafka_dlt-exception-fqcn", "kafka_dlt-exception-message", "kafka_dlt-exception-stacktrace",
               "kafka_dlt-original-topic", "kafka_dlt-original-partition", "kafka_dlt-original-offset",
               "kafka_dlt-original-timestamp", "kafka_dlt-original-consumer-group", "kstore_dlt-attempts")
#: The stack trace header is cut to this many bytes: a dead letter's record must stay publishable.
DLT_STACKTRACE_BYTES = 8192


def topic_record(topic: str, group: str, record: Record, failure: Failure) -> Produced:
    """A dead letter as its dead-letter topic's record: the original key, value and headers, and headers
    naming the error, where the message came from and its attempts (see :data:`DLT_HEADERS`; the
    partition is a 4-byte and the offset and timestamp 8-byte big-endian integers, as Spring writes them)."""
    stamp = timestamp_ms(record)
    added = dict(zip(DLT_HEADERS, (
        failure.kind.encode(), failure.message.encode("utf-8", "replace"),
        failure.traceback.encode("utf-8", "replace")[-DLT_STACKTRACE_BYTES:],
        record.topic.encode(), record.partition.to_bytes(4, "big", signed=True),
        record.offset.to_bytes(8, "big", signed=True),
        (stamp if stamp is not None else -1).to_bytes(8, "big", signed=True),
        group.encode(), str(failure.attempts).encode(),
    ), strict=True))
    headers = tuple((name, value) for name, value in (record.headers or ()) if name not in added)
    return Produced(topic, record.value, record.key, (*headers, *added.items()), None)


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in ids)


#: How many groups an unknown group's error names.
_GROUPS_LISTED = 20


class DeadLetters:
    """Dead letters of one database."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self._own_engine = engine is None
        self.engine = engine or make_engine(settings)
        self.table = build_table(settings.table_prefix, settings.schema)
        self.history_table = build_history_table(settings.table_prefix, settings.schema)
        if self._own_engine:
            check_migrated(self.engine, settings)

    def __enter__(self) -> DeadLetters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own_engine:
            self.engine.dispose()

    def check_known(self, group: str) -> None:
        """Raise :class:`ConfigurationError` if ``group`` has no dead letter of any status and no stored
        offset in this database (a typo, most likely), naming the groups that have dead letters."""
        t = self.table
        offsets, _ = build_tables(self.settings.table_prefix, self.settings.schema)
        with self.engine.connect() as conn:
            if conn.execute(select(t.c.id).where(t.c.consumer_group == group).limit(1)).first() is not None:
                return
            if conn.execute(select(offsets.c.consumer_group).where(offsets.c.consumer_group == group)
                            .limit(1)).first() is not None:
                return
            known = list(conn.execute(select(t.c.consumer_group).distinct().order_by(t.c.consumer_group)
                                      .limit(_GROUPS_LISTED + 1)).scalars())
        if not known:
            others = "no group has any yet"
        else:
            more = " and more" if len(known) > _GROUPS_LISTED else ""
            others = f"groups that have some: {', '.join(known[:_GROUPS_LISTED])}{more}"
        raise ConfigurationError(f"group {group!r} has no dead letters and no stored offsets in "
                                 f"{self.settings.safe_dsn}; {others}")

    def get(self, dead_letter_id: int) -> DeadLetter:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.table).where(self.table.c.id == dead_letter_id)).first()
        if row is None:
            raise KstoreError(f"no dead letter with id {dead_letter_id}")
        return _row(row)

    def history(self, dead_letter_id: int) -> list[Change]:
        """Every status change of one dead letter, oldest first."""
        h = self.history_table
        stmt = select(h).where(h.c.dead_letter_id == dead_letter_id).order_by(h.c.id)
        with self.engine.connect() as conn:
            return [_change(r) for r in conn.execute(stmt)]

    def discard(self, ids: Sequence[int], reason: str, *, group: str | None = None) -> StatusChange:
        """Mark dead letters ``discarded`` (dropped on purpose), all in one transaction; see :meth:`_close`."""
        return self._close(ids, DISCARDED, reason, group)

    def resolve(self, ids: Sequence[int], reason: str, *, group: str | None = None) -> StatusChange:
        """Mark dead letters ``resolved`` (fixed by hand elsewhere), all in one transaction; see :meth:`_close`."""
        return self._close(ids, RESOLVED, reason, group)

    def close_waiting(self, ids: Sequence[int], status: str, reason: str, group: str) -> StatusChange:
        """Move those of ``ids`` still waiting (dead) in ``group`` to ``status``, in one transaction, and
        leave the rest (gone, of another group, or no longer dead: another operator got there first).

        For a walk over the letters a filter matched, read before this locks them; see :meth:`_close`.
        """
        return self._close(ids, status, reason, group, lenient=True)

    def _close(self, ids: Sequence[int], status: str, reason: str, group: str | None,
               lenient: bool = False) -> StatusChange:
        """Move ``ids`` from dead to ``status``, recording who, when and why, in one transaction.

        All or nothing: an unknown id, one of another group (if ``group`` is given) or one that left
        ``dead`` another way raises and changes nothing (``lenient``: changes the others, and leaves
        those). Ids already in ``status`` are left as they are
        (listed in ``already``), so running the same command twice is harmless. A lost COMMIT answer
        is read back by request id: landed returns as usual; not landed raises :class:`DatabaseError`
        (safe to run again); unreadable raises :class:`CommitInDoubtError`.
        """
        action = ACTIONS[status]
        wanted = sorted(set(ids))
        if not wanted:
            raise ConfigurationError(f"give the dead letters to {action} (--id N, repeatable)")
        if not reason.strip():
            raise ConfigurationError(f"give a reason for the {action} (--reason)")
        request_id = uuid.uuid4().hex
        try:
            with self.engine.connect() as conn:  # closing it rolls back whatever did not commit
                conn.execution_options(**WRITES).begin()
                rows = self._lock(conn, wanted, nowait=True)
                if not lenient:
                    self._refuse(conn, rows, wanted, action, status, group)
                todo = [i for i in wanted if i in rows and rows[i].status == DEAD
                        and group in (None, rows[i].consumer_group)]
                already = [i for i in wanted if i in rows and rows[i].status == status]
                if not todo:
                    return StatusChange(status, [], already, None)
                self._mark(conn, todo, status)
                for i in todo:
                    self._record(conn, i, rows[i].consumer_group, action, status, reason, request_id)
                indoubt.commit(conn, lambda: self._landed(wanted, request_id),
                               what=f"{action} {request_id} of dead letter(s) {_ids(todo)}",
                               check=f"`kstore dead-letters show {todo[0]}` (its history lists request {request_id} "
                                     "if it landed)")
        except SQLAlchemyError as exc:
            raise DatabaseError(f"the {action} of dead letter(s) {_ids(wanted)} did not land ({first_line(exc)}): "
                                "nothing changed; it is safe to run it again") from None
        log.debug("%s dead letter(s) %s (request %s): %s", status, _ids(todo), request_id, reason)
        return StatusChange(status, todo, already, request_id)

    def _lock(self, conn: Connection, ids: Sequence[int], nowait: bool = False) -> dict[int, Any]:
        """The letters' rows, locked until the transaction ends (PostgreSQL; SQLite's BEGIN IMMEDIATE locks all).

        ``nowait``: a row another transaction holds (a replay running) raises :class:`DeadLetterBusyError`
        at once instead of waiting for it.
        """
        t = self.table
        stmt = select(t.c.id, t.c.consumer_group, t.c.status).where(t.c.id.in_(ids)).with_for_update(nowait=nowait)
        try:
            return {r.id: r for r in conn.execute(stmt)}
        except OperationalError as exc:
            if nowait and sqlstate(exc) == "55P03":  # lock_not_available
                raise DeadLetterBusyError(
                    f"dead letter(s) {_ids(ids)}: another operator is replaying or changing it right now; nothing "
                    f"was done (see `kstore dead-letters show {ids[0]}` once they are done)") from None
            raise

    def _refuse(self, conn: Connection, rows: dict[int, Any], ids: Sequence[int], action: str, status: str,
                group: str | None) -> None:
        missing = [i for i in ids if i not in rows]
        if missing:
            raise KstoreError(f"no dead letter with id {_ids(missing)}: nothing changed")
        strangers = [i for i in ids if group is not None and rows[i].consumer_group != group]
        if strangers:
            raise DeadLetterStateError(f"dead letter(s) {_ids(strangers)} are not of group {group!r}: nothing changed")
        closed = [i for i in ids if rows[i].status not in (DEAD, status)]
        if closed:
            why = "; ".join(self.state_note(conn, i, rows[i].status) for i in closed)
            raise DeadLetterStateError(f"cannot {action} {why}; only a waiting (dead) letter can be {status}, "
                                       "nothing changed")

    def state_note(self, conn: Connection, dead_letter_id: int, status: str) -> str:
        """``dead letter 5: it was discarded by ann@box at 2026-12-02 10:00:00 (duplicate)``, for refusals."""
        h = self.history_table
        last = conn.execute(select(h).where(h.c.dead_letter_id == dead_letter_id, h.c.to_status == status)
                            .order_by(h.c.id.desc()).limit(1)).first()
        if last is None:  # replayed before migration 0005 kept a history
            return f"dead letter {dead_letter_id}: it is {status}"
        change = _change(last)
        why = f" ({change.reason})" if change.reason else ""
        return f"dead letter {dead_letter_id}: it was {status} by {change.by} at {change.at:%Y-%m-%d %H:%M:%S}{why}"

    def _mark(self, conn: Connection, ids: Sequence[int], status: str) -> None:
        t = self.table
        values: dict[str, Any] = {"status": status}
        if status == REPLAYED:
            values["replayed_at"] = now()
        marked = conn.execute(t.update().where(t.c.id.in_(ids), t.c.status == DEAD).values(**values)).rowcount
        if marked != len(ids):  # the rows are locked: this would be a bug, not a race
            raise DatabaseError(f"marking dead letter(s) {_ids(ids)} {status} changed {marked} row(s)")

    def _record(self, conn: Connection, dead_letter_id: int, group: str, action: str, status: str,
                reason: str | None, request_id: str, edited: tuple[bytes | None, bytes | None] | None = None) -> None:
        user, host = actor()
        conn.execute(self.history_table.insert().values(
            dead_letter_id=dead_letter_id, consumer_group=group, action=action, from_status=DEAD, to_status=status,
            at=now(), by_user=user, by_host=host, reason=reason, request_id=request_id, edited=edited is not None,
            replayed_key=edited[0] if edited else None, replayed_value=edited[1] if edited else None,
        ))

    def _landed(self, ids: Sequence[int], request_id: str) -> bool:
        """On a fresh connection: is change ``request_id`` in the history? (After its COMMIT's answer was lost.)"""
        h = self.history_table
        with self.engine.connect() as conn:
            conn.execution_options(**WRITES).begin()
            indoubt.wait_for_locks(conn)
            self._lock(conn, ids)  # waits for the lost transaction, if it still holds the rows
            return conn.execute(select(h.c.id).where(h.c.request_id == request_id).limit(1)).first() is not None

    def replay(self, letter: DeadLetter, run: Callable[[Connection], None], *,
               edited: tuple[bytes | None, bytes | None] | None = None, reason: str | None = None) -> bool:
        """Mark one dead letter replayed in the transaction of its effects: ``run(conn)`` writes them
        (the processor's, see :func:`kstore.ops.replay.replay`).

        The letter is locked before ``run`` and until COMMIT. True if its effects and its 'replayed'
        mark committed; False if it was already replayed. Raises what ``run`` raises (nothing is
        committed then; see :meth:`note_failure`), :class:`DeadLetterBusyError` at once if another
        transaction holds the letter (a replay running), and :class:`DeadLetterStateError` if it
        was discarded or resolved. ``edited``, the key and value the processor got instead of
        the letter's own, is recorded in the history with the replay; the letter keeps the original
        message. If the COMMIT's answer is lost, the replay is looked up by its request id: found, it
        landed (True); not found, the COMMIT's error is raised (it may be replayed again);
        unreadable, :class:`CommitInDoubtError`.
        """
        request_id = uuid.uuid4().hex
        with self.engine.connect() as conn:  # closing it rolls back whatever did not commit
            # On SQLite, BEGIN IMMEDIATE: wait for a running worker's batch instead of failing.
            conn.execution_options(**WRITES).begin()
            # Locked before the processor runs, and held until COMMIT: a second replay (or a discard,
            # a resolve) meanwhile is refused at once, rather than running too and finding out after.
            rows = self._lock(conn, [letter.id], nowait=True)
            if letter.id not in rows:
                raise KstoreError(f"dead letter {letter.id} is gone")
            status = rows[letter.id].status
            if status == REPLAYED:  # replayed since it was read: do not apply it twice
                return False
            if status != DEAD:
                raise DeadLetterStateError(f"cannot replay {self.state_note(conn, letter.id, status)}")
            run(conn)
            self._mark(conn, [letter.id], REPLAYED)
            self._record(conn, letter.id, letter.consumer_group, ACTIONS[REPLAYED], REPLAYED, reason, request_id,
                         edited=edited)
            # The mark, the history row and the effects commit together: the row read back tells whether all landed.
            indoubt.commit(
                conn, lambda: self._landed([letter.id], request_id),
                what=f"the replay of dead letter {letter.id} (request {request_id})",
                check=f"`kstore dead-letters show {letter.id}` (status replayed: it landed; dead: it did not)",
            )
            return True

    def note_failure(self, letter: DeadLetter, exc: BaseException, reason: str | None = None,
                     edited: tuple[bytes | None, bytes | None] | None = None) -> bool:
        """A replay of ``letter`` failed with ``exc`` (its transaction rolled back): the letter takes the
        failure (one more attempt, this error and traceback, the time) and the history a ``dead -> dead``
        row, in one transaction. False if the letter left ``dead`` meanwhile (nothing is written)."""
        failure = Failure()
        failure.record(exc)
        t = self.table
        with self.engine.connect() as conn:
            conn.execution_options(**WRITES).begin()
            # first_error takes the error it was dead-lettered with, once: SET reads the row as it was.
            updated = conn.execute(t.update().where(t.c.id == letter.id, t.c.status == DEAD).values(
                attempts=t.c.attempts + 1, last_failure_at=failure.last_at, error=failure.error,
                traceback=failure.traceback, first_error=func.coalesce(t.c.first_error, t.c.error))).rowcount
            if updated != 1:
                return False
            self._record(conn, letter.id, letter.consumer_group, ACTIONS[REPLAYED], DEAD, reason, uuid.uuid4().hex,
                         edited=edited)
            conn.commit()
        return True


def _row(r: Any) -> DeadLetter:
    return DeadLetter(
        id=r.id, consumer_group=r.consumer_group, topic=r.topic, partition_id=r.partition_id, offset=r.offset,
        key=r.key, value=r.value, headers=_decode_headers(r.headers), timestamp=r.timestamp, error=r.error,
        traceback=r.traceback, attempts=r.attempts, first_failure_at=r.first_failure_at,
        last_failure_at=r.last_failure_at, status=r.status, replayed_at=r.replayed_at, first_error=r.first_error,
    )


def _change(r: Any) -> Change:
    return Change(
        dead_letter_id=r.dead_letter_id, action=r.action, from_status=r.from_status, to_status=r.to_status, at=r.at,
        by_user=r.by_user, by_host=r.by_host, reason=r.reason, request_id=r.request_id, edited=bool(r.edited),
        replayed_key=r.replayed_key, replayed_value=r.replayed_value,
    )


def discard_dead_letters(settings: Settings, group: str, ids: Sequence[int], reason: str) -> StatusChange:
    """Mark a group's dead letters discarded (dropped on purpose), with a reason, in one transaction."""
    with DeadLetters(settings) as letters:
        return letters.discard(ids, reason, group=group)


def resolve_dead_letters(settings: Settings, group: str, ids: Sequence[int], reason: str) -> StatusChange:
    """Mark a group's dead letters resolved (fixed by hand elsewhere), with a reason, in one transaction."""
    with DeadLetters(settings) as letters:
        return letters.resolve(ids, reason, group=group)


def show_dead_letter(settings: Settings, dead_letter_id: int) -> tuple[DeadLetter, list[Change]]:
    """One dead letter and its history (oldest first)."""
    with DeadLetters(settings) as letters:
        return letters.get(dead_letter_id), letters.history(dead_letter_id)

