"""Commits in doubt against the real PostgreSQL: a psycopg2 (or psycopg 3) connection whose COMMIT's answer
can be lost.

``lossy_engine(settings, faults)`` is kstore's own engine (``make_engine``) whose
connections are real psycopg2 connections of a subclass: the next COMMITs can be
made to fail the way a cut connection fails them.

- ``"lost"``: the server commits, then the connection is closed and the caller
  gets "server closed the connection unexpectedly" (the write landed);
- ``"refused"``: the connection is closed before the COMMIT is sent, same error
  (the server rolls the transaction back: the write did not land).

With ``down_after_fault`` every new connection fails from then on (the database
unreachable), so reading the outcome back fails too. ``Faults.cut`` records each
COMMIT a fault took, with the statements of the transaction it ended, so a test
can show that its fault fired, and on the write it is about. Imported without a
package (``PYTHONPATH=tests``) by the CLI test's subprocess, hence no relative imports.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
from sqlalchemy import Engine, event

from kstore import Settings
from kstore.db.store import make_engine

CUT = "server closed the connection unexpectedly"


@dataclass(frozen=True)
class CutCommit:
    """A COMMIT a fault took: the fault, and the statements of the transaction it ended (in order)."""

    fault: str
    statements: tuple[str, ...]

    def wrote(self, table: str) -> bool:
        """Whether that transaction INSERTed into, UPDATEd or DELETEd from ``table``."""
        pattern = re.compile(rf"\s*(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+\"?{re.escape(table)}\"?[\s(]", re.I)
        return any(pattern.match(sql) for sql in self.statements)


@dataclass
class Faults:
    """What the next COMMITs of a lossy engine do ("lost" or "refused"), in order; then they behave."""

    commits: list[str] = field(default_factory=list)
    down_after_fault: bool = False
    down: bool = False
    #: How many connections were refused while down (so a test can tell the read back was tried).
    refused_connections: int = 0
    #: Every COMMIT a fault took, in order (so a test can tell the fault fired, and on which write).
    cut: list[CutCommit] = field(default_factory=list)


def _statements(conn: Any) -> list[str]:
    """The statements sent on DBAPI connection ``conn`` since its last COMMIT or ROLLBACK."""
    statements: list[str] = conn.__dict__.setdefault("lossy_statements", [])
    return statements


def _track_statements(engine: Engine) -> None:
    @event.listens_for(engine, "before_cursor_execute")
    def _seen(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        _statements(cursor.connection).append(statement)


def lossy_engine(settings: Settings, faults: Faults) -> Engine:
    engine = _lossy_engine(settings, faults)
    _track_statements(engine)
    return engine


def _lossy_engine(settings: Settings, faults: Faults) -> Engine:
    if "+psycopg:" in settings.dsn:
        # psycopg 3: on top of kstore's own connection class (its deadline off: these tests are
        # about the COMMIT, not a silence), in its place: kstore connects with the dialect's class.
        engine = make_engine(settings.replace(db_timeout_s=0))
        engine.dialect.kstore_connection_class = _psycopg3_connection_class(faults)  # type: ignore[attr-defined]
        return engine
    engine = make_engine(settings)
    classes: dict[type[Any], type[Any]] = {}

    @event.listens_for(engine, "do_connect")
    def _lossy(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        # On top of the connection class kstore itself uses (if any), so the rest behaves as in production.
        base = cparams.get("connection_factory") or psycopg2.extensions.connection
        if base not in classes:
            classes[base] = _connection_class(faults, base)
        cparams["connection_factory"] = classes[base]

    return engine


def _psycopg3_connection_class(faults: Faults) -> type[Any]:
    """The same faults on a psycopg 3 connection (``postgresql+psycopg://``)."""
    import psycopg

    from kstore.db.dbapi import psycopg_connection_class

    class LossyConnection3(psycopg_connection_class(0)):  # type: ignore[misc]
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:
            if faults.down:
                faults.refused_connections += 1
                raise psycopg.OperationalError('connection to server at "127.0.0.1" failed: Connection refused')
            return super().connect(*args, **kwargs)

        def commit(self) -> None:
            _commit(faults, self, super().commit, psycopg.OperationalError)

        def rollback(self) -> None:
            _statements(self).clear()
            super().rollback()

    return LossyConnection3


def _connection_class(faults: Faults, base: type[Any]) -> type[Any]:
    class LossyConnection(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if faults.down:
                faults.refused_connections += 1
                raise psycopg2.OperationalError('connection to server at "127.0.0.1" failed: Connection refused')
            super().__init__(*args, **kwargs)

        def commit(self) -> None:
            _commit(faults, self, super().commit, psycopg2.OperationalError)

        def rollback(self) -> None:
            _statements(self).clear()
            super().rollback()

    return LossyConnection


def _commit(faults: Faults, conn: Any, commit: Any, error: type[Exception]) -> None:
    """COMMIT as the next fault says: as usual, "lost" (it lands, then the connection is cut) or
    "refused" (cut before it is sent); either way the caller gets the driver's cut-connection error."""
    fault = faults.commits.pop(0) if faults.commits else None
    statements = tuple(_statements(conn))
    _statements(conn).clear()
    if fault is None:
        commit()
        return
    assert fault in ("lost", "refused"), fault
    faults.cut.append(CutCommit(fault, statements))
    if fault == "lost":
        commit()
    conn.close()  # the connection is gone, as after a cut: the server ends the session
    faults.down = faults.down_after_fault
    raise error(CUT)


def run_cli_in_doubt(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real kstore CLI (``kstore args...``) in a subprocess whose ``module``'s engines are lossy:
    the next COMMIT lands, its answer is lost, and the database then refuses connections, so the
    outcome cannot be read back."""
    script = (f"import sys, lossy, {module}\n"
              "from kstore.cli import main\n"
              "faults = lossy.Faults(commits=['lost'], down_after_fault=True)\n"
              f"{module}.make_engine = lambda s: lossy.lossy_engine(s, faults)\n"
              "main(sys.argv[1:])\n")
    support = Path(__file__).resolve().parent
    path = os.pathsep.join([str(support), str(support.parents[1])])
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=support, env={**os.environ, "PYTHONPATH": path})
