"""The database side of the simulation: one SQLite file per schedule, faults at the
DBAPI level, and a journal of every committed write.

- A template database is migrated once (``kstore.migrate``) and gets the
  processor's effects table, the journal table and triggers; each schedule copies it.
- Every kstore engine (``kstore.engine.worker.make_engine`` is replaced by
  :meth:`Databases.make_engine`) hands out :class:`FaultyConnection` objects,
  which fail statements and commits as the schedule's :class:`Faults` say, and
  count each fault that fired (:attr:`Databases.fired`).
- A COMMIT whose answer is lost is a cut connection, as on a real network: the
  driver reports the connection gone (SQLAlchemy invalidates it; every later use
  of it fails) and the COMMIT's fate is one of :data:`LOST_ANSWER_OUTCOMES`: it
  landed before the cut, it never reached the server (rolled back), or it is still
  in flight: the transaction keeps its locks (SQLite's write lock) and lands a few
  statements later (of any connection), at the latest when the action ends. A
  plain read back in between still sees the rows as they were: the worker must
  not take that for "not landed, retry freely"; a retry of the same batch under
  the same epoch then meets rows that already moved (what the offsets
  compare-and-set's position check is for).
- Triggers write every insert/update of ``kstore_offsets``, every effect and
  every dead-lettering (a new letter, or a failure added to the message's waiting
  letter) to ``sim_journal``; a commit that wrote anything adds a
  ``commit`` row naming who committed, so the journal holds each transaction's
  writes followed by its commit marker, in commit order.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Engine, event

import kstore
from kstore.db.store import make_engine as real_make_engine
from kstore.settings import Settings

SIM_DDL = """
CREATE TABLE sim_effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL, partition_id INTEGER NOT NULL, kafka_offset INTEGER NOT NULL,
    value BLOB, worker TEXT NOT NULL, epoch INTEGER NOT NULL
);
CREATE TABLE sim_journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL, topic TEXT, partition_id INTEGER,
    old_next INTEGER, new_next INTEGER, old_epoch INTEGER, new_epoch INTEGER,
    old_owner TEXT, new_owner TEXT, label TEXT
);
CREATE TRIGGER sim_effect AFTER INSERT ON sim_effects BEGIN
    INSERT INTO sim_journal (kind, topic, partition_id, new_next, label)
    VALUES ('effect', NEW.topic, NEW.partition_id, NEW.kafka_offset, NEW.worker);
END;
CREATE TRIGGER sim_dead AFTER INSERT ON kstore_dead_letters BEGIN
    INSERT INTO sim_journal (kind, topic, partition_id, new_next)
    VALUES ('dead', NEW.topic, NEW.partition_id, NEW."offset");
END;
CREATE TRIGGER sim_dead_again AFTER UPDATE ON kstore_dead_letters WHEN NEW.attempts > OLD.attempts BEGIN
    INSERT INTO sim_journal (kind, topic, partition_id, new_next)
    VALUES ('dead', NEW.topic, NEW.partition_id, NEW."offset");
END;
CREATE TRIGGER sim_row AFTER INSERT ON kstore_offsets BEGIN
    INSERT INTO sim_journal (kind, topic, partition_id, new_next, new_epoch, new_owner)
    VALUES ('insert', NEW.topic, NEW.partition_id, NEW.next_offset, NEW.epoch, NEW.owner);
END;
CREATE TRIGGER sim_update AFTER UPDATE ON kstore_offsets BEGIN
    INSERT INTO sim_journal (kind, topic, partition_id, old_next, new_next, old_epoch, new_epoch,
                             old_owner, new_owner)
    VALUES ('update', NEW.topic, NEW.partition_id, OLD.next_offset, NEW.next_offset, OLD.epoch, NEW.epoch,
            OLD.owner, NEW.owner);
END;
"""

#: The message of every injected failure: what SQLite says when the disk goes away,
#: a transient error (retry later), not one about the statement.
FAULT_MESSAGE = "disk I/O error"
#: What sqlite3 says when its connection is gone; SQLAlchemy takes it for a disconnect (it
#: invalidates the connection, and kstore classifies the error as the database's, not the batch's).
CUT_MESSAGE = "Cannot operate on a closed database."
#: What became of a COMMIT whose answer was lost (see the module docstring), drawn with these
#: weights: "late" is the one that makes a retry of the same batch dangerous.
LOST_ANSWER_OUTCOMES = {"landed": 1, "late": 2, "never": 1}
#: A late COMMIT lands before one of the next 2..N statements run on the database (so after
#: the next one: a read back of its rows, say), or when the action ends.
LATE_STATEMENTS = 6


class JournalRow(NamedTuple):
    id: int
    kind: str
    topic: str | None
    partition_id: int | None
    old_next: int | None
    new_next: int | None
    old_epoch: int | None
    new_epoch: int | None
    old_owner: str | None
    new_owner: str | None
    label: str | None


@dataclass
class Faults:
    """One engine's armed faults (one-shot counters) and the shared outage flag; ``fired``
    counts each fault that went off, by kind (shared by all the engines of a schedule)."""

    down: bool = False
    #: The next N commits land, then raise (the answer was lost): a commit in doubt.
    lose_commit_answers: int = 0
    #: The next N commits fail before landing.
    fail_commits: int = 0
    #: The next N statements fail.
    fail_statements: int = 0
    fired: Counter[str] = field(default_factory=Counter)

    def clear(self) -> None:
        self.down = False
        self.lose_commit_answers = self.fail_commits = self.fail_statements = 0

    def statement(self) -> None:
        if self.down:
            self._fail("down")
        if self.fail_statements > 0:
            self.fail_statements -= 1
            self._fail("fail_statement")

    def before_commit(self) -> bool:
        """Raise if the commit fails before landing; True if its answer is to be lost."""
        if self.down:
            self._fail("down")
        if self.fail_commits > 0:
            self.fail_commits -= 1
            self._fail("fail_commit")
        if self.lose_commit_answers > 0:
            self.lose_commit_answers -= 1
            return True
        return False

    def _fail(self, kind: str) -> None:
        self.fired[kind] += 1
        raise sqlite3.OperationalError(FAULT_MESSAGE)


@dataclass
class InFlight:
    """A COMMIT sent on a connection since cut, not applied yet: its transaction holds its locks."""

    real: sqlite3.Connection
    label: str
    statements_left: int


def _cut() -> sqlite3.ProgrammingError:
    return sqlite3.ProgrammingError(CUT_MESSAGE)


class FaultyCursor:
    """A sqlite3 cursor whose statements fail while the connection's faults say so."""

    def __init__(self, real: sqlite3.Cursor, conn: FaultyConnection) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_conn", conn)

    def execute(self, statement: str, parameters: Any = ()) -> Any:
        self._conn.before_statement(statement)
        return self._real.execute(statement, parameters)

    def executemany(self, statement: str, seq: Any) -> Any:
        self._conn.before_statement(statement)
        return self._real.executemany(statement, seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._real)


class FaultyConnection:
    """A sqlite3 connection with injected faults and a journal marker on each writing commit.

    After a lost answer it is cut (see the module docstring): every use fails as on a
    closed connection, and closing it does nothing (the simulation owns what is left of it).
    """

    def __init__(self, real: sqlite3.Connection, faults: Faults, label: str,
                 on_statement: Callable[[], None] | None, db: Databases | None = None) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_faults", faults)
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_on_statement", on_statement)
        object.__setattr__(self, "_db", db)
        object.__setattr__(self, "_cut", False)
        object.__setattr__(self, "_changes_at_begin", real.total_changes)

    def cursor(self, *args: Any, **kwargs: Any) -> FaultyCursor:
        if self._cut:
            raise _cut()
        return FaultyCursor(self._real.cursor(*args, **kwargs), self)

    def before_statement(self, statement: str) -> None:
        if self._on_statement is not None:
            self._on_statement()  # another thread of the worker may take a turn here (see threads.py)
        if self._cut:
            raise _cut()
        if self._db is not None and statement.lstrip()[:6].upper() != "PRAGMA":
            self._db.tick_in_flight()  # a new connection's set-up is not a round trip of its own
        self._faults.statement()
        if statement.lstrip()[:5].upper() == "BEGIN":
            object.__setattr__(self, "_changes_at_begin", self._real.total_changes)

    def commit(self) -> None:
        if self._cut:
            raise _cut()
        real = self._real
        try:
            lose_answer = self._faults.before_commit()
        except sqlite3.OperationalError:
            real.rollback()  # failed before landing
            raise
        if real.in_transaction and real.total_changes != self._changes_at_begin:
            real.execute("INSERT INTO sim_journal (kind, label) VALUES ('commit', ?)", (self._label,))
        if lose_answer and self._db is not None:
            object.__setattr__(self, "_cut", True)
            self._db.lose_answer(real, self._label, self._faults)
            raise _cut()
        real.commit()

    def rollback(self) -> None:
        if self._cut:
            raise _cut()
        self._real.rollback()

    def close(self) -> None:
        if not self._cut:
            self._real.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)


_templates: dict[str, Path] = {}
#: One engine per label for the whole process (SQLAlchemy caches compiled statements per engine,
#: and compiling them again for every schedule cost a fifth of the run time). Each opens its
#: connections on the database of the schedule running now (``_current``); every schedule
#: ends by disposing of them.
_engines: dict[str, Engine] = {}
_current: dict[str, Databases] = {}


def _engine(label: str, settings: Settings) -> Engine:
    """kstore's ``make_engine`` (its pragmas and BEGIN), handing out this schedule's faulty connections."""
    engine = _engines.get(label)
    if engine is not None:
        return engine
    engine = real_make_engine(settings)

    @event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, _rec: Any, _cargs: Any, cparams: Any) -> FaultyConnection:
        return _current[label].connect(label, dialect, cparams)

    @event.listens_for(engine, "connect")
    def _no_busy_wait(dbapi_conn: Any, _rec: Any) -> None:
        # One thread: a lock held by another connection is a transaction left open
        # between turns. Fail at once instead of waiting kstore's busy_timeout.
        dbapi_conn._real.execute("PRAGMA busy_timeout=0")

    # The first connection of an engine runs SQLAlchemy's dialect setup (more statements):
    # done here, so every schedule sees the same statements whichever ran first.
    with _current[label].warming():
        engine.connect().close()
    engine.dispose()
    _engines[label] = engine
    return engine


def template(directory: Path) -> Path:
    """A migrated database with the simulation's tables and triggers, built once per directory
    and process (``adopt_template`` lets another process use one already built)."""
    key = str(directory)
    if key in _templates:
        return _templates[key]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "template.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    kstore.migrate(Settings(dsn=f"sqlite:///{path}"))
    conn = sqlite3.connect(path)
    conn.executescript(SIM_DDL)
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    _templates[key] = path
    return path


def adopt_template(directory: Path, path: Path) -> None:
    """Use the template another process built for ``directory`` (building it again would race)."""
    _templates[str(directory)] = path


class Databases:
    """One schedule's database: its file, its engines' faults, its journal."""

    def __init__(self, template_path: Path, path: Path,
                 on_statement: Callable[[str], None] | None = None, rng: random.Random | None = None,
                 trace: list[str] | None = None) -> None:
        self.path = path
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(template_path, path)
        self.dsn = f"sqlite:///{path}"
        self.faults: dict[str, Faults] = {}
        #: Faults that went off, by kind ("lost_answer" also by outcome: "lost_answer/late", ...).
        self.fired: Counter[str] = Counter()
        #: COMMITs whose answer was lost and which have not landed yet.
        self.in_flight: list[InFlight] = []
        #: Labels of the engines one of whose COMMITs landed late (after its answer was lost).
        self.landed_late: set[str] = set()
        self.rng = rng or random.Random(0)
        self.trace: list[str] = [] if trace is None else trace
        self.down = False
        self._on_statement = on_statement
        self._reader = sqlite3.connect(path, isolation_level=None)
        self._last_id = 0
        self._warming = False
        self.engines: list[Engine] = []

    def faults_of(self, label: str) -> Faults:
        faults = self.faults.get(label)
        if faults is None:
            faults = self.faults[label] = Faults(fired=self.fired)
        return faults

    def lose_answer(self, real: sqlite3.Connection, label: str, faults: Faults) -> None:
        """A COMMIT was sent and its connection cut before the answer came: decide its fate."""
        outcome = self.rng.choices(list(LOST_ANSWER_OUTCOMES), list(LOST_ANSWER_OUTCOMES.values()))[0]
        faults.fired["lost_answer"] += 1
        faults.fired[f"lost_answer/{outcome}"] += 1
        self.trace.append(f"  {label}: the answer to a COMMIT is lost, its connection cut; the COMMIT: {outcome}")
        if outcome == "late" and real.in_transaction:
            self.in_flight.append(InFlight(real, label, self.rng.randint(2, LATE_STATEMENTS)))
            return
        if outcome == "never":
            real.rollback()  # the server saw the connection go before the COMMIT: it aborts
        else:
            real.commit()
        real.close()

    def tick_in_flight(self) -> None:
        """Before any statement on the database: the COMMITs in flight whose time has come land."""
        for flight in list(self.in_flight):
            flight.statements_left -= 1
            if flight.statements_left <= 0:
                self._land(flight)

    def settle(self) -> None:
        """The end of an action: every COMMIT still in flight lands (a server applies what it received)."""
        for flight in list(self.in_flight):
            self._land(flight)

    def _land(self, flight: InFlight) -> None:
        self.in_flight.remove(flight)
        self.fired["lost_answer/late landed"] += 1
        self.landed_late.add(flight.label)
        self.trace.append(f"  {flight.label}: its COMMIT in flight lands now")
        flight.real.commit()
        flight.real.close()

    def set_down(self, down: bool) -> None:
        self.down = down
        for label, faults in self.faults.items():
            if label != "operator":
                faults.down = down

    def make_engine(self, settings: Settings) -> Engine:
        """kstore's own engine for a worker (or the operator), labelled by the client id, on this database."""
        label = settings.client_id or "operator"
        self.faults_of(label).down = self.down and label != "operator"
        _current[label] = self
        engine = _engine(label, settings)
        self.engines.append(engine)
        return engine

    def connect(self, label: str, dialect: Any, cparams: Any) -> FaultyConnection:
        real = dialect.loaded_dbapi.connect(str(self.path), **cparams)
        if self._warming:
            return FaultyConnection(real, Faults(), label, None)
        faults = self.faults_of(label)
        faults.statement()  # a database that is down refuses connections too
        hook = self._on_statement
        on_statement = (lambda: hook(label)) if hook is not None and label != "operator" else None
        return FaultyConnection(real, faults, label, on_statement, self)

    @contextmanager
    def warming(self) -> Iterator[None]:
        """Connections without faults or preemption (a new engine's first connection)."""
        self._warming = True
        try:
            yield
        finally:
            self._warming = False

    def journal(self) -> list[JournalRow]:
        """Journal rows committed since the last call, in commit order."""
        rows = self._reader.execute(
            "SELECT id, kind, topic, partition_id, old_next, new_next, old_epoch, new_epoch, old_owner, new_owner,"
            " label FROM sim_journal WHERE id > ? ORDER BY id", (self._last_id,)).fetchall()
        if rows:
            self._last_id = rows[-1][0]
        return [JournalRow(*r) for r in rows]

    def query(self, sql: str, params: Any = ()) -> list[Any]:
        return self._reader.execute(sql, params).fetchall()

    def write_locked(self) -> bool:
        """True if a connection holds SQLite's write lock (a transaction left open between steps)."""
        try:
            self._reader.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return True
        self._reader.execute("ROLLBACK")
        return False

    def close(self) -> None:
        for flight in list(self.in_flight):  # a schedule stopped by a violation: the process is gone
            self.in_flight.remove(flight)
            flight.real.close()
        for engine in {id(e): e for e in self.engines}.values():
            engine.dispose()  # connections of kstore's engines never outlive a schedule
        self._reader.close()

    def remove(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
