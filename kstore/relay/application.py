"""The application's outbox: :class:`Outbox` and :class:`Record`, imported by users from
:mod:`kstore.outbox` (whose docstring is the user's guide to it).

Records are made and checked as a processor's are (:mod:`kstore.running.handler`), kept in a
SQLAlchemy ``Session`` until its ``before_commit`` (or written at once on a ``Connection``), and
written by :meth:`kstore.relay.writing.OutboxWrites.write` in the committing transaction, in shard
order: published once if, and only if, that transaction commits.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from kstore.errors import ConfigurationError, KstoreError
from kstore.running.handler import Outgoing, produce_check
from kstore.schemas import Formats, Schema
from kstore.settings import Settings
from kstore.types import Produced

from .store import Outbox as _Tables

__all__ = ["Outbox", "Record"]

#: Where a Session keeps the records of its transaction that wait for its commit, by outbox.
_PENDING = "kstore.outbox"


class Record(NamedTuple):
    """One record for :meth:`Outbox.produce_many`: the arguments of :meth:`Outbox.produce` but the first."""

    topic: str
    value: Any
    key: Any = None
    headers: Any = None
    partition: int | None = None
    schema: Schema | None = None
    key_schema: Schema | None = None


class Outbox:
    """An application's outbox, under a name of its choosing (published by ``kstore relay --outbox NAME``;
    a worker's relay publishes it too if the name is the worker's group).

    ``shards``: how many transactions can commit records at once (see :mod:`kstore.outbox`), made
    by the first :meth:`setup` (or ``produce()``) and fixed from then on (a relay waits for the
    application to make them): an outbox found with another count raises
    :class:`~kstore.errors.ConfigurationError` (to change it: ``kstore outbox reshard``). ``None``:
    whatever count it has, or ``outbox_shards`` if it is new.
    ``settings``: its ``table_prefix`` and ``schema`` (kstore's tables), ``outbox_max_record_bytes``,
    and the schema registry for records produced with a schema; default: :class:`~kstore.settings.Settings`' own.
    """

    #: Shards of an application's outbox unless given: concurrent requests commit side by side (past
    #: eight, the relay publishes them in eight lanes: more shards cost it no more producers).
    DEFAULT_SHARDS = 16

    def __init__(self, name: str, settings: Settings | None = None, *, shards: int | None = DEFAULT_SHARDS) -> None:
        if not isinstance(name, str) or not name.strip():
            raise KstoreError(f"an outbox needs a name, got {name!r}")
        if shards is not None and shards < 1:
            raise KstoreError(f"an outbox needs at least one shard, got {shards}")
        self.name = name
        self.shards = shards
        self.settings = settings or Settings()
        self._formats = Formats.of(_NoFormats, self.settings)
        self._check = produce_check(None, self.settings.outbox_max_record_bytes)
        #: The outbox's statements, by engine (an application may have more than one database).
        self._tables: weakref.WeakKeyDictionary[Engine, _Tables] = weakref.WeakKeyDictionary()

    def setup(self, engine: Engine) -> int:
        """Make the outbox's shards if it has none; return how many it has. Call it at the application's
        start (``produce()`` does it otherwise, at its first record, in a transaction of its own): a
        relay started before waits for it. An outbox that has another count than ``shards`` raises
        :class:`~kstore.errors.ConfigurationError`, here and at every ``produce()``."""
        return self._of(engine, make=True).shards

    def produce(self, target: Session | Connection | Any, topic: str, value: Any, *, key: Any = None,
                headers: Any = None, partition: int | None = None, schema: Schema | None = None,
                key_schema: Schema | None = None) -> None:
        """Produce a record in ``target``'s transaction (a ``Session``, an ``AsyncSession`` or a ``Connection``
        with a transaction begun): published once if, and only if, that transaction commits.

        ``value``, ``key``, ``headers``, ``partition``, ``schema`` and ``key_schema`` as for
        :meth:`kstore.Processor.produce`. A record that can never be published raises
        :class:`~kstore.ProduceError` here."""
        self.produce_many(target, [Record(topic, value, key, headers, partition, schema, key_schema)])

    def produce_many(self, target: Session | Connection | Any, records: Iterable[Record]) -> None:
        """Produce several records in ``target``'s transaction, in the order given (see :meth:`produce`)."""
        made = self._make(records)
        if not made:
            return
        session = getattr(target, "sync_session", target)  # an AsyncSession's own Session
        if isinstance(session, Session):
            # The shards are known (or made) now, not in the commit: on SQLite a transaction of its own
            # could not write while the session's holds the database's lock.
            bind = session.get_bind()
            self._of(bind.engine if isinstance(bind, Connection) else bind)
            self._wait_for_commit(session, made)
        elif isinstance(target, Connection):
            if not target.in_transaction():
                raise KstoreError("Outbox.produce() needs a transaction begun on the connection: its records are "
                                  "published if, and only if, that transaction commits")
            self._of(target.engine).write(target, made)
        else:
            raise KstoreError(f"Outbox.produce() writes in a SQLAlchemy Session, AsyncSession or Connection, "
                              f"not a {type(target).__name__}")

    def _make(self, records: Iterable[Record]) -> list[Produced]:
        outgoing = Outgoing(self._check)
        outgoing.formats = self._formats
        for r in records:
            outgoing.add(r.topic, r.value, r.key, r.headers, r.partition, r.schema, r.key_schema)
        return outgoing.records

    def _wait_for_commit(self, session: Session, made: Sequence[Produced]) -> None:
        """Keep the records in the session, with the (sub)transaction they were produced in, until its
        ``before_commit`` writes them (listened to once per session)."""
        pending: list[tuple[Outbox, Any, list[Produced]]] | None = session.info.get(_PENDING)
        if pending is None:
            _listen()
            pending = session.info[_PENDING] = []
        transaction = session.get_nested_transaction() or session.get_transaction()
        if transaction is None:
            transaction = session.begin()  # autobegin would too, at the first statement
        pending.append((self, transaction, list(made)))

    def _of(self, engine: Engine, make: bool = False) -> _Tables:
        tables = self._tables.get(engine)
        if tables is None:
            tables = _Tables(engine, self.name, self.settings.table_prefix, self.settings.schema)
            self._tables[engine] = tables
        if not tables.shards or make:
            tables.ensure_shards(self.settings.outbox_shards if self.shards is None else self.shards)
        if self.shards is not None and tables.shards != self.shards:
            raise _other_count(self.name, tables.shards, self.shards)
        return tables

    def __repr__(self) -> str:
        return f"Outbox({self.name!r})"


def _other_count(name: str, have: int, asked: int) -> ConfigurationError:
    return ConfigurationError(
        f"outbox {name!r} has {have} shard(s), not the {asked} asked for: it was made with {have} (by a setup() "
        f"with another count, a relay with --create, or a relay of an earlier kstore started before the "
        f"application); to change it, drain the outbox, stop its relays and run kstore outbox reshard {name} "
        f"--shards {asked} (see docs/producing.md#changing-the-shard-count), or ask for Outbox({name!r}, "
        f"shards={have})")


class _NoFormats:
    """What :class:`Formats` reads of a processor: an application's outbox reads nothing."""

    key_format = value_format = "bytes"


_listening = threading.Lock()


def _listen() -> None:
    """Listen to every Session's commit and rollback, once per process: a listener on each session
    cost more than its outbox write (SQLAlchemy builds a dispatcher of the instance's own). A
    session that produced nothing returns from both at once."""
    with _listening:
        if not event.contains(Session, "before_commit", _write_pending):
            event.listen(Session, "before_commit", _write_pending)
            event.listen(Session, "after_soft_rollback", _drop_rolled_back)


def _write_pending(session: Session) -> None:
    """A session's ``before_commit``: its transaction's records, into their outboxes, each outbox's in one
    write (in shard order: the shards' locks are taken in one order by every transaction)."""
    pending: list[tuple[Outbox, Any, list[Produced]]] | None = session.info.get(_PENDING)
    if not pending:
        return
    # The session's own changes first: not written while this transaction holds the shards' locks
    # (its commit would flush them after this hook).
    session.flush()
    by_outbox: dict[Outbox, list[Produced]] = {}
    for outbox, _, records in pending:
        by_outbox.setdefault(outbox, []).extend(records)
    pending.clear()
    for outbox, records in by_outbox.items():
        conn = session.connection()
        outbox._of(conn.engine).write(conn, records)


def _drop_rolled_back(session: Session, previous_transaction: Any) -> None:
    """The records produced in a rolled-back transaction (or a savepoint, or inside one) are never written."""
    pending: list[tuple[Outbox, Any, list[Produced]]] | None = session.info.get(_PENDING)
    if not pending:
        return
    kept = [entry for entry in pending if not _within(entry[1], previous_transaction)]
    pending[:] = kept


def _within(transaction: Any, ended: Any) -> bool:
    while transaction is not None:
        if transaction is ended:
            return True
        transaction = transaction.parent
    return False
