"""A group's outbox as an operator sees it: ``kstore outbox show`` is :func:`show_outbox`, ``kstore
outbox reshard`` :func:`reshard_outbox`.

Read from the database alone, no broker needed: per shard, the records committed and not yet
published (rows waiting, and the age of the oldest), how far the shard has been numbered
(``next_seq``) and published (``published_seq``, the relay's mark in the database), and which
relay holds it, with how long its lease has left. The published mark is the database's copy:
the relay's progress is committed first inside each Kafka transaction and marked here at most
a second later (at once when the shard is idle), so the mark and the rows waiting can lag by
that much; a relay that stopped in between is replaced by one that reads Kafka's record and
catches the mark up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from kstore.db.migration import check_migrated
from kstore.db.sqlerrors import first_line
from kstore.db.store import Store, make_engine
from kstore.db.writes import aware
from kstore.errors import ConfigurationError, DatabaseError, KstoreError
from kstore.relay.store import Outbox
from kstore.relay.tables import Backlog, Refusal, ShardState, backlogs, build_tables, groups_with_outbox
from kstore.settings import Settings


@dataclass(frozen=True)
class ShardStatus:
    """One outbox shard of a group."""

    shard: int
    #: Records committed and not yet published (their rows are deleted once marked published).
    waiting: int
    #: When the oldest of them was written (its batch's commit), or None if none waits.
    oldest: datetime | None
    #: Seconds since then, by this machine's clock; None if none waits.
    oldest_age_s: float | None
    #: The seq the shard's next record gets (records are numbered from 1, in commit order).
    next_seq: int
    #: The last seq the database records as published.
    published_seq: int
    #: The relay holding the shard's lease (``kstore-<host>-<pid>-<id>``, the worker's name for a worker's own
    #: relay), or None.
    owner: str | None
    epoch: int
    #: Seconds left on the owner's lease; 0 once it ran out (another relay may take the shard).
    lease_left_s: float
    #: The last row Kafka refused in the shard (its seq, when, Kafka's answer), or None.
    refused: Refusal | None = None

    @property
    def refusal(self) -> str | None:
        """The last refusal in a line, or None: what ``kstore outbox show`` and the console print."""
        r = self.refused
        if r is None:
            return None
        since = "published past it since" if self.published_seq >= r.seq else "the shard waits on it"
        return f"seq {r.seq} refused at {r.at:%Y-%m-%d %H:%M:%S} UTC: {r.reason} ({since})"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["oldest"] = self.oldest.isoformat() if self.oldest else None
        d["refused"] = None if self.refused is None else {**asdict(self.refused), "at": self.refused.at.isoformat()}
        return d


def show_outbox(settings: Settings, group: str, now: datetime | None = None) -> list[ShardStatus]:
    """Rows waiting, the oldest's age, next and published seq, relay and lease left of each outbox shard of a group.

    A group with no outbox shards in this database (no worker or relay of it has started
    here) raises :class:`ConfigurationError` naming the groups that have some.
    """
    with _outbox(settings, group) as (engine, outbox):
        shards = outbox.state()
        known = [] if shards else _known(engine, outbox)
    if not shards:
        others = f"outboxes there are: {', '.join(known)}" if known else "there is none yet"
        raise ConfigurationError(f"{group!r} has no outbox in this database (a group's shards are made when its "
                                 f"first worker or relay starts, an application's by its Outbox(...).setup() or "
                                 f"first produce()); {others}")
    at = now or datetime.now(timezone.utc)
    return [_status(s, at) for s in shards]


@dataclass(frozen=True)
class Resharded:
    """What :func:`reshard_outbox` did: the outbox's shards before and after."""

    name: str
    before: int
    after: int


def reshard_outbox(settings: Settings, name: str, shards: int) -> Resharded:
    """Make the outbox ``name`` anew with ``shards`` shards, in one transaction (see
    :meth:`kstore.relay.shards.OutboxShards.reshard`: numbering goes on, exactly once holds across it).

    Refused (:class:`~kstore.errors.OutboxBusyError`) while records wait in it or a relay of it runs;
    an outbox this database does not have raises :class:`ConfigurationError` naming those it has.
    """
    if shards < 1:
        raise KstoreError(f"an outbox needs at least one shard, got {shards}")
    with _outbox(settings, name) as (engine, outbox):
        before = outbox.reshard(shards)
        known = [] if before else _known(engine, outbox)
    if not before:
        others = f"outboxes it has: {', '.join(known)}" if known else "it has none yet"
        raise ConfigurationError(f"outbox {name!r} does not exist in this database; {others}")
    return Resharded(name, before, shards)


def list_outboxes(engine: Engine, settings: Settings) -> list[Backlog]:
    """Every outbox in the database, a group's and an application's alike, by name: its records waiting
    and when the oldest was written, in one cheap statement (:func:`kstore.relay.tables.backlogs`)."""
    with engine.connect() as conn:
        return backlogs(conn, build_tables(settings.table_prefix, settings.schema))


@contextmanager
def _outbox(settings: Settings, name: str) -> Iterator[tuple[Engine, Outbox]]:
    """The outbox ``name`` of a reachable, migrated database, on an engine of its own for the call; a
    database error inside becomes one line."""
    engine = make_engine(settings)
    try:
        Store(engine, settings).check_reachable()
        check_migrated(engine, settings)
        try:
            yield engine, Outbox(engine, name, settings.table_prefix, settings.schema)
        except SQLAlchemyError as exc:
            raise DatabaseError(f"database {settings.safe_dsn}: {first_line(exc)}") from None
    finally:
        engine.dispose()


def _known(engine: Engine, outbox: Outbox) -> list[str]:
    with engine.connect() as conn:
        return sorted(groups_with_outbox(conn, outbox.tables))


def _status(state: ShardState, at: datetime) -> ShardStatus:
    oldest = None if state.oldest is None else aware(state.oldest)
    age = None if oldest is None else max(0.0, (at - oldest).total_seconds())
    return ShardStatus(state.shard, state.waiting, oldest, age, state.next_seq, state.published_seq, state.owner,
                       state.epoch, state.lease_left_s, state.refused)

