"""kstore's SQL tables and every statement on them.

All writes use bound parameters. A claim and an offset commit both take the
partition row's lock, which is what fences a zombie worker: once another worker
has claimed a row (bumping ``epoch``), an UPDATE ``WHERE epoch = <old>``
matches nothing and the zombie's transaction is rolled back.

An offset commit is a compare-and-set: it also matches the ``next_offset`` the
worker believes is stored (where the batch starts). The epoch alone does not
make a retried commit safe: after a COMMIT whose answer was lost, the same
batch re-run under the same epoch would match again and its effects would land
twice. With the start position in the predicate the second attempt matches
nothing; and the worker reads the row back before retrying anyway (see
:mod:`kstore.engine.commit`).

On PostgreSQL through psycopg2 the compare-and-set and the COMMIT travel in one
round trip (:meth:`Store.commit_in_one_round_trip`): the batch connection runs in
psycopg2's autocommit mode, kstore sends its own ``BEGIN`` (with the batch's first
statement: :mod:`kstore.db.dbapi`), and the last message of a batch is
``<compare-and-set>; COMMIT``. A compare-and-set that
matched fewer rows than the batch's partitions raises inside the server, so the
``COMMIT`` after it never runs: a fenced batch cannot land. One round trip fewer
per batch: one network round trip of latency against a remote database, and about
0.2 ms of a worker's transaction against a local one (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
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
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    column,
    create_engine,
    event,
    select,
    table,
    text,
    tuple_,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.sql.elements import TextClause

from kstore.errors import ConfigurationError, DatabaseError, FencedError
from kstore.settings import Settings
from kstore.types import Position, TopicPartition

from . import dbapi, deadline, indoubt, resets
from .members import GroupMembers, stale_after_s
from .sqlerrors import first_line
from .writes import WRITES, now

log = logging.getLogger(__name__)

#: What an offset commit writes for one partition: (expected next_offset, new next_offset, epoch).

#: The text a fenced one-round-trip commit fails with (inside PostgreSQL's "invalid input syntax
#: for type integer" error, SQLSTATE 22P02, which quotes it whatever the server's language).
FENCED_MARK = "kstore: fenced, not committed"
#: The same for a batch whose transaction is not the one kstore began (the processor ended it
#: with a COMMIT or ROLLBACK of its own through SQL): see kstore.db.dbapi.BEGIN_BATCH.
ENDED_MARK = "kstore: transaction ended inside the batch, not committed"
_INVALID_TEXT_REPRESENTATION = "22P02"


class FencedCommit(Exception):
    """A one-round-trip commit matched fewer offset rows than it moves: nothing was committed."""


class TransactionEnded(Exception):
    """The batch's transaction was ended inside the batch (a COMMIT or ROLLBACK the processor sent
    itself): the offsets were not committed, and whatever it committed before cannot be undone."""


@dataclass(frozen=True)
class Claim:
    """A partition's stored position (None: never stored) and the epoch this worker now holds."""

    next_offset: int | None
    epoch: int


@dataclass(frozen=True)
class Row:
    """A stored partition row, as read without claiming it."""

    next_offset: int | None
    epoch: int
    owner: str | None
    updated_at: datetime | None


@dataclass(frozen=True)
class HistoryEntry:
    """One recorded reset (or note)."""

    consumer_group: str
    topic: str
    partition_id: int
    from_offset: int | None
    to_offset: int | None
    epoch: int
    at: datetime
    by_user: str
    by_host: str
    reason: str
    #: The request that wrote it (one per reset, shared by its partitions), to look a reset up
    #: after its COMMIT's answer was lost; None for notes and for rows older than migration 0004.
    request_id: str | None = None


def build_tables(prefix: str = "kstore_", schema: str | None = None) -> tuple[Table, Table]:
    """The offsets and reset-history tables, named with ``prefix`` inside ``schema``."""
    md = MetaData(schema=schema)
    offsets = Table(
        f"{prefix}offsets",
        md,
        Column("consumer_group", String(255), primary_key=True),
        Column("topic", String(255), primary_key=True),
        Column("partition_id", Integer, primary_key=True),
        Column("next_offset", BigInteger, nullable=True),
        Column("epoch", BigInteger, nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        Column("metadata", Text, nullable=True),
        Column("owner", String(255), nullable=True),
    )
    history = Table(
        f"{prefix}offset_history",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("consumer_group", String(255), nullable=False),
        Column("topic", String(255), nullable=False),
        Column("partition_id", Integer, nullable=False),
        Column("from_offset", BigInteger, nullable=True),
        Column("to_offset", BigInteger, nullable=True),
        Column("epoch", BigInteger, nullable=False),
        Column("at", DateTime(timezone=True), nullable=False),
        Column("by_user", String(255), nullable=False),
        Column("by_host", String(255), nullable=False),
        Column("reason", Text, nullable=False),
        Column("request_id", String(32), nullable=True),
    )
    return offsets, history


def make_engine(settings: Settings) -> Engine:
    """An engine for ``settings.dsn`` with kstore's per-connection safety settings."""
    url = settings.dsn
    _check_driver(make_url(url), settings.safe_dsn)
    # No pool_pre_ping: it would cost a round trip per batch. A connection that died
    # (database restarted) fails its batch, which is rolled back and retried.
    kwargs: dict[str, Any] = {}
    if url.startswith("postgresql"):
        parsed = make_url(url)
        kwargs["connect_args"] = {
            "options": _server_options(settings, parsed.query.get("options")),
            # A database that goes silent must not hang the worker (see kstore/db/deadline.py).
            **deadline.connect_args(settings.db_timeout_s, dict(parsed.query)),
        }
        if parsed.get_driver_name() == "psycopg2":
            # The deadline per round trip, the batch's BEGIN and the refusal of a processor's own
            # commit()/rollback() inside a batch (kstore/db/dbapi.py).
            from .psycopg2conn import psycopg2_connection_class  # psycopg2 DSNs only: kstore needs no driver

            kwargs["connect_args"]["connection_factory"] = psycopg2_connection_class(settings.db_timeout_s)
            # Never psycopg2's execute_batch: it joins a page of statements with ";" on one line,
            # so a statement ending with a "--" comment swallows the rest of its page, silently.
            # Many rows of an INSERT kstore.db.manyrows does not send as one statement go as its own
            # checked pages; any other executemany is psycopg2's, a statement per row.
            kwargs["executemany_mode"] = "values_only"
    elif url.startswith("sqlite"):
        kwargs["connect_args"] = {"factory": dbapi.SQLiteConnection}
    try:
        # Values bound to a failed statement stay out of its error text (a message's contents):
        # hide_parameters, unless log_statement_parameters asks for them.
        engine = create_engine(url, hide_parameters=not settings.log_statement_parameters, **kwargs)
    except (SQLAlchemyError, ImportError) as exc:
        raise ConfigurationError(f"cannot use DSN {settings.safe_dsn}: {exc}") from None
    if engine.dialect.driver == "psycopg":
        # The class is looked up at each connect, so that a test can put a subclass of it in its place.
        engine.dialect.kstore_connection_class = dbapi.psycopg_connection_class(settings.db_timeout_s)  # type: ignore[attr-defined]
        event.listen(engine, "do_connect", lambda dialect, _record, cargs, cparams:
                     dialect.kstore_connection_class.connect(*cargs, **cparams))
    if engine.dialect.driver == "psycopg2":
        event.listen(engine, "reset", _no_transaction_back_into_the_pool)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
    elif engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"unsupported database {engine.dialect.name!r}: kstore supports PostgreSQL and SQLite"
        )
    return engine


#: How a user installs each PostgreSQL driver kstore supports (kstore itself depends on neither).
DRIVER_EXTRAS = {"psycopg2": "kstore[psycopg2]", "psycopg": "kstore[psycopg]"}


def _check_driver(url: URL, safe_dsn: str) -> None:
    """Fail in one line, naming the extra to install, when the DSN's driver cannot be imported
    (``postgresql://`` means psycopg2, ``postgresql+psycopg://`` psycopg 3). Before anything else:
    kstore's own psycopg2 classes import psycopg2 too."""
    try:
        dialect = url.get_dialect()
    except SQLAlchemyError:
        return  # an unknown database or driver: create_engine says so
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigurationError(f"cannot use DSN {safe_dsn}: {_driver_problem(dialect.driver, exc)}") from None


def _driver_problem(driver: str, exc: ImportError) -> str:
    extra = DRIVER_EXTRAS.get(driver)
    missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] == driver
    if extra is None:
        return f"its driver {driver} cannot be imported: {exc}"
    if not missing:
        # psycopg 3 without a libpq to load ("no pq wrapper available"), or a broken install.
        hint = " (psycopg 3 needs the system's libpq, or pip install 'psycopg[binary]')" if driver == "psycopg" else ""
        return f"its driver {driver} is installed but cannot be imported{hint}: {first_line(exc)}"
    other = next(d for d in DRIVER_EXTRAS if d != driver)
    scheme = "postgresql+psycopg://" if other == "psycopg" else "postgresql+psycopg2://"
    return (f"its driver {driver} is not installed: pip install '{extra}' "
            f"(or use {other} with pip install '{DRIVER_EXTRAS[other]}' and a {scheme} DSN)")


def _server_options(settings: Settings, given: str | tuple[str, ...] | None) -> str:
    """libpq's ``options`` for kstore's connections: kstore's own, then the DSN's ``options=``
    (or, without one, ``PGOPTIONS``), which a connection argument would otherwise replace: a
    ``search_path`` or ``statement_timeout`` given there still applies (and wins if it sets
    the same parameter)."""
    # A zombie paused inside a transaction must not hold the offsets' row
    # locks past the Kafka session timeout, or the new owner's claim stalls.
    ours = f"-c idle_in_transaction_session_timeout={settings.idle_in_transaction_timeout_ms}"
    theirs = " ".join(given) if isinstance(given, tuple) else given
    if theirs is None:
        theirs = os.environ.get("PGOPTIONS", "")
    return f"{ours} {theirs}".strip()


def _no_transaction_back_into_the_pool(dbapi_conn: Any, _record: Any, _state: Any) -> None:
    """A psycopg2 connection in autocommit mode may hold a transaction kstore began with its own
    ``BEGIN`` (the batch connection: :meth:`Store.commit_in_one_round_trip`), which psycopg2's
    ``rollback()`` does not know of and would leave open. Whatever path returns it to the pool,
    it goes back with that transaction rolled back (or, if that fails, is discarded by the pool),
    never to have another user's statements run and commit inside a half-done batch."""
    if getattr(dbapi_conn, "kstore_begin", None) is not None:
        dbapi_conn.kstore_begin = None  # a batch that never began: its BEGIN is not the next user's
    import psycopg2.extensions as ext  # this listener is only installed on psycopg2 engines

    if dbapi_conn.info.transaction_status == ext.TRANSACTION_STATUS_IDLE or dbapi_conn.status != ext.STATUS_READY:
        return  # nothing open, or a transaction psycopg2 began itself (SQLAlchemy's rollback ends that)
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True  # whether SQLAlchemy reset it already or not: no BEGIN before this
    try:
        with dbapi_conn.cursor() as cur:
            cur.execute("ROLLBACK")
    finally:
        dbapi_conn.autocommit = autocommit


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # The sqlite3 module opens transactions itself, late (before the first write) and
    # in ways that break SAVEPOINT; kstore opens them instead (see _sqlite_begin), as
    # SQLAlchemy's documentation recommends, so a processor's begin_nested() works.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    # WAL lets `kstore offsets show` read while a worker writes; the busy
    # timeout makes a second writer wait instead of failing at once.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    # In WAL mode, NORMAL skips the fsync per commit. A power loss may then undo the
    # last commits, but effects and offsets are undone together: those messages are
    # processed again, so exactly-once holds, at a fraction of the cost per batch.
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _sqlite_begin(conn: Connection) -> None:
    mode = conn.get_execution_options().get("kstore_sqlite_begin", "")
    conn.exec_driver_sql(f"BEGIN {mode}".rstrip())


class Store:
    """Statements on the offsets and history tables for one database."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.offsets, self.history = build_tables(settings.table_prefix, settings.schema)
        self._commit_statements: dict[tuple[int, bool], TextClause] = {}
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        #: Whether batches commit with :meth:`commit_in_one_round_trip` (see the module's docstring).
        #: psycopg 3 sends parameters apart from the statement, one statement per message, and SQLite
        #: has no round trips: both take :meth:`commit_offsets`, then a COMMIT of their own.
        self.one_round_trip_commit = engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg2"

    def database_id(self) -> str:
        """This database's identity (migration 0006): one random id, the same for every route to it."""
        prefix, schema = self.settings.table_prefix, self.settings.schema
        identity = table(f"{prefix}identity", column("id"), schema=schema)
        try:
            with self.engine.connect() as conn:
                found = conn.execute(select(identity.c.id).limit(1)).scalar()
        except SQLAlchemyError as exc:
            raise DatabaseError(
                f"cannot read kstore's identity in {self.settings.safe_dsn}: {first_line(exc)}") from None
        if found is None:
            raise DatabaseError(f"{prefix}identity in {self.settings.safe_dsn} is empty: run `kstore migrate` again")
        return str(found)

    def registered_members(self, group: str) -> set[str]:
        """The names and Kafka member ids of the group's live workers that write to this database
        (their rows in the registry, :mod:`kstore.db.members`)."""
        try:
            live = GroupMembers(self.engine, group, self.settings.table_prefix, self.settings.schema).live(
                stale_after_s(self.settings.session_timeout_ms))
        except SQLAlchemyError as exc:
            raise DatabaseError(
                f"cannot read the workers of group {group!r} in {self.settings.safe_dsn}: {first_line(exc)}") from None
        return {m.member for m in live} | {m.kafka_member_id for m in live if m.kafka_member_id}

    def check_reachable(self) -> None:
        """Raise :class:`DatabaseError` with a one-line reason if the database cannot be used."""
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as exc:
            raise DatabaseError(
                f"cannot connect to database {self.settings.safe_dsn}: {first_line(exc)}"
            ) from None

    @contextmanager
    def claiming(
        self, group: str, partitions: Iterable[TopicPartition], owner: str
    ) -> Iterator[tuple[Connection, dict[TopicPartition, Claim]]]:
        """Claim partitions for worker ``owner``: bump each row's epoch (creating missing rows).

        One statement for all partitions, inside a transaction that stays open for the
        block, so the caller can write where each partition starts (:meth:`start_at`)
        in the same transaction: the claim and the starting positions land together
        or not at all. The returned epochs fence every earlier owner: their commits
        ``WHERE epoch = <theirs>`` now match nothing.

        A claim whose COMMIT fails is never resolved by reading back: the caller
        simply claims again. That is safe either way: a claim has no effects, and a
        claim that did land only bumped an epoch nobody else holds.
        """
        stamp = now()
        rows = [
            {"consumer_group": group, "topic": t, "partition_id": p, "next_offset": None,
             "epoch": 1, "updated_at": stamp, "owner": owner}
            for t, p in partitions
        ]
        o = self.offsets
        stmt = self._insert(o).values(rows).on_conflict_do_update(
            index_elements=[o.c.consumer_group, o.c.topic, o.c.partition_id],
            set_={"epoch": o.c.epoch + 1, "updated_at": stamp, "owner": owner},
        ).returning(o.c.topic, o.c.partition_id, o.c.next_offset, o.c.epoch)
        with self.engine.connect() as conn, conn.execution_options(**WRITES).begin():
            claims: dict[TopicPartition, Claim] = {}
            if rows:
                if conn.dialect.name == "postgresql":
                    # A zombie holding the row lock must make the claim fail (and be
                    # retried), not hang the new owner's poll loop.
                    conn.execute(text(f"SET LOCAL lock_timeout = {int(self.settings.claim_lock_timeout_ms)}"))
                claims = {(r.topic, r.partition_id): Claim(r.next_offset, r.epoch) for r in conn.execute(stmt)}
            yield conn, claims

    def start_at(self, conn: Connection, group: str, tp: TopicPartition, offset: int, epoch: int,
                 reason: str, from_offset: int | None) -> None:
        """Inside a claim: store where a partition starts (no offset stored, or below the log
        start) and record it in the history. The epoch is the claim's own, not bumped again."""
        o = self.offsets
        done = conn.execute(o.update().where(
            o.c.consumer_group == group, o.c.topic == tp[0], o.c.partition_id == tp[1], o.c.epoch == epoch,
        ).values(next_offset=offset, updated_at=now())).rowcount
        if done != 1:  # the claim's transaction holds the row lock: this cannot happen
            raise FencedError(f"{tp[0]}[{tp[1]}] of group {group!r} changed inside its own claim")
        self._record(conn, group, tp, from_offset, offset, epoch, reason)

    def commit_offsets(
        self, conn: Connection, group: str, positions: Mapping[TopicPartition, Position]
    ) -> set[TopicPartition]:
        """Move ``next_offset`` for each partition, only where the epoch is still ours and
        the stored offset is still where this worker believes it is (compare-and-set).

        ``positions`` maps a partition to ``(expected next_offset, new next_offset,
        claimed epoch)``. One statement; returns the partitions that did NOT match
        (fenced, or moved under us). The caller must roll back if that set is not empty.
        """
        if not positions:
            return set()
        rows = conn.execute(self._commit_statement(len(positions), commit=False), _commit_params(group, positions))
        return set(positions) - {(r[0], r[1]) for r in rows}

    def commit_in_one_round_trip(
        self, conn: Connection, group: str, positions: Mapping[TopicPartition, Position]
    ) -> None:
        """The compare-and-set of :meth:`commit_offsets`, then COMMIT, in one round trip.

        Only for a psycopg2 connection in autocommit mode whose transaction kstore began
        with :data:`kstore.db.dbapi.BEGIN_BATCH` (:attr:`one_round_trip_commit`). Raises
        :class:`FencedCommit` if any partition did not match, and :class:`TransactionEnded` if
        the transaction is not the one kstore began: in both the server raised before the
        COMMIT and nothing of it was committed. Any other error may have come after the
        COMMIT ran: the caller must treat it as a commit in doubt.
        """
        if not positions:
            conn.exec_driver_sql("COMMIT")
            return
        try:
            conn.execute(self._commit_statement(len(positions), commit=True), _commit_params(group, positions))
        except DBAPIError as exc:
            orig = exc.orig
            if getattr(orig, "pgcode", None) == _INVALID_TEXT_REPRESENTATION:
                if ENDED_MARK in str(orig):
                    raise TransactionEnded(first_line(exc)) from exc
                if FENCED_MARK in str(orig):
                    raise FencedCommit(f"fenced: {first_line(exc)}") from exc
            raise

    @staticmethod
    def check_own_transaction(conn: Connection) -> None:
        """On SQLite, raise :class:`TransactionEnded` if ``conn``'s DBAPI connection is not inside a
        transaction any more (the processor committed or rolled back through SQL: kstore began it
        with the batch, and nothing else begins one). psycopg2's batches check it in the server
        (:meth:`commit_in_one_round_trip`), and both psycopg drivers after every round trip
        (:mod:`kstore.db.dbapi`)."""
        if conn.dialect.name == "sqlite" and not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
            raise TransactionEnded("the batch's transaction was ended inside the batch (a COMMIT or ROLLBACK)")

    def _commit_statement(self, n: int, *, commit: bool) -> TextClause:
        """The offset commit for ``n`` partitions, built once per ``n``.

        This runs once per batch, so it is plain SQL with numbered parameters:
        building it from Core expressions each time cost more CPU than the rest
        of a no-op batch, and a fixed text is cached by SQLAlchemy after its
        first use. Same statement on PostgreSQL and SQLite (>= 3.35, RETURNING).

        ``commit``: the same UPDATE as a data-modifying CTE whose row count is checked by
        a cast that fails unless all ``n`` rows matched, then ``; COMMIT`` (PostgreSQL,
        psycopg2: one simple-query message, whose statements after a failed one never run).
        """
        stmt = self._commit_statements.get((n, commit))
        if stmt is None:
            q = self.engine.dialect.identifier_preparer
            topic, part, nxt, epoch = (q.quote(c) for c in ("topic", "partition_id", "next_offset", "epoch"))
            whens = " ".join(f"WHEN {topic} = :t{i} AND {part} = :p{i} THEN :n{i}" for i in range(n))
            keys = " OR ".join(f"({topic} = :t{i} AND {part} = :p{i} AND {epoch} = :e{i} AND {nxt} = :s{i})"
                               for i in range(n))
            update = (
                f"UPDATE {q.format_table(self.offsets)} "
                f"SET {nxt} = CASE {whens} ELSE {nxt} END, {q.quote('updated_at')} = :u "
                f"WHERE {q.quote('consumer_group')} = :g AND ({keys}) RETURNING {topic}, {part}"
            )
            if commit:
                # The CASE depends on the rows and on the transaction's own setting, so the cast
                # runs (and fails) only when fenced or when the batch's transaction was ended.
                update = (f"WITH moved AS ({update}) SELECT CAST(CASE "
                          f"WHEN current_setting('kstore.batch', true) IS DISTINCT FROM 'on' THEN '{ENDED_MARK}' "
                          f"WHEN count(*) = {n} THEN '0' ELSE '{FENCED_MARK}' END AS integer) FROM moved; COMMIT")
            stmt = text(update).bindparams(bindparam("u", type_=DateTime(timezone=True)))
            self._commit_statements[(n, commit)] = stmt
        return stmt

    def reset(
        self,
        group: str,
        tp: TopicPartition,
        to_offset: int,
        *,
        expected_epoch: int | None,
        reason: str,
    ) -> int:
        """Set a partition's ``next_offset``, bump its epoch and record it in the history.

        With ``expected_epoch`` the reset only happens if this caller still
        owns that epoch (else :class:`FencedError`). Without, it always wins (an
        admin reset; the row is created if missing) and keeps the owner, who
        notices the new epoch and adopts the new position. Returns the new epoch.

        On SQLite it waits for a worker's write instead of failing, and a COMMIT
        whose answer is lost is resolved by reading the history back: see
        :func:`kstore.db.resets.move`.
        """
        fence = {} if expected_epoch is None else {tp: expected_epoch}
        (moved,) = resets.move(self, group, [tp], lambda _tp, _stored: to_offset, reason=reason,
                               expected_epochs=fence)
        return moved.epoch

    def note(self, group: str, tp: TopicPartition, offset: int | None, epoch: int, reason: str) -> None:
        """Record an event in the history without moving anything (e.g. a partition held back)."""
        with self.engine.begin() as conn:
            self._record(conn, group, tp, offset, offset, epoch, reason)

    def _record(
        self, conn: Connection, group: str, tp: TopicPartition,
        from_offset: int | None, to_offset: int | None, epoch: int, reason: str, *, request_id: str | None = None,
    ) -> None:
        resets.record(conn, self.history, group, tp, from_offset, to_offset, epoch, reason, request_id=request_id)

    def rows(
        self, group: str, topic: str | None = None, partitions: Iterable[TopicPartition] | None = None,
        *, wait_for_locks: bool = False,
    ) -> dict[TopicPartition, Row]:
        """Stored rows of a group (optionally one topic, or some partitions), without claiming them.

        ``wait_for_locks``: read them as a commit in doubt is read back, waiting (within a bound) for
        a transaction that still holds their locks, such as a COMMIT the server is still applying
        (:func:`kstore.db.indoubt.wait_for_locks`): a plain read would not see it yet."""
        o = self.offsets
        stmt = select(o.c.topic, o.c.partition_id, o.c.next_offset, o.c.epoch, o.c.owner, o.c.updated_at).where(
            o.c.consumer_group == group
        )
        if topic is not None:
            stmt = stmt.where(o.c.topic == topic)
        if partitions is not None:
            keys = list(partitions)
            if not keys:
                return {}
            stmt = stmt.where(tuple_(o.c.topic, o.c.partition_id).in_(keys))
        with self.engine.connect() as conn:
            if wait_for_locks:
                # Rolled back when the connection closes: the locks are only waited for (on SQLite,
                # BEGIN IMMEDIATE waits, within the busy timeout, for a writer still committing).
                conn = conn.execution_options(**WRITES)
                conn.begin()
                indoubt.wait_for_locks(conn)
                stmt = stmt.with_for_update(read=True)
            return {
                (r.topic, r.partition_id): Row(r.next_offset, r.epoch, r.owner, r.updated_at)
                for r in conn.execute(stmt)
            }

    def groups(self) -> list[str]:
        """Every group with at least one stored offset row, sorted."""
        o = self.offsets
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(select(o.c.consumer_group).distinct().order_by(o.c.consumer_group))]

    def history_entries(self, group: str, topic: str | None = None, limit: int = 50) -> list[HistoryEntry]:
        """The most recent resets of a group, newest first."""
        h = self.history
        stmt = select(h).where(h.c.consumer_group == group).order_by(h.c.id.desc()).limit(limit)
        if topic is not None:
            stmt = stmt.where(h.c.topic == topic)
        with self.engine.connect() as conn:
            return [
                HistoryEntry(r.consumer_group, r.topic, r.partition_id, r.from_offset, r.to_offset, r.epoch,
                             r.at, r.by_user, r.by_host, r.reason, r.request_id)
                for r in conn.execute(stmt)
            ]


def _commit_params(group: str, positions: Mapping[TopicPartition, Position]) -> dict[str, Any]:
    params: dict[str, Any] = {"g": group, "u": now()}
    for i, ((t, p), (start, nxt, epoch)) in enumerate(positions.items()):
        params[f"t{i}"], params[f"p{i}"], params[f"n{i}"], params[f"e{i}"] = t, p, nxt, epoch
        params[f"s{i}"] = start
    return params
