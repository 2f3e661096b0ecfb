"""Creating and checking kstore's tables with its Alembic migrations (``migrations/``, shipped in the wheel)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from kstore.errors import ConfigurationError, DatabaseError, NotMigratedError
from kstore.settings import Settings

from .sqlerrors import first_line
from .store import make_engine


def script_location() -> str:
    """Where kstore's Alembic scripts are: inside the installed package (a wheel ships the
    top-level ``migrations/`` as ``kstore/migrations``), or at the top of a checkout."""
    package = Path(__file__).resolve().parent.parent  # kstore/, this module being kstore/db/migration.py
    installed = package / "migrations"
    if (installed / "env.py").is_file():
        return str(installed)
    return str(package.parent / "migrations")


def alembic_config(settings: Settings) -> Config:
    """An Alembic config for kstore's own migrations (see :func:`script_location`)."""
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    # '%' is ConfigParser's interpolation character; a password may hold one.
    cfg.set_main_option("sqlalchemy.url", settings.dsn.replace("%", "%%"))
    cfg.attributes["table_prefix"] = settings.table_prefix
    cfg.attributes["schema"] = settings.schema
    return cfg


@dataclass(frozen=True)
class Migration:
    """What :func:`upgrade` did: the revision before (None: no kstore tables) and after, and the head."""

    before: str | None
    after: str
    head: str

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def describe(self) -> str:
        """One line for ``kstore migrate``: what it did, or that there was nothing to do."""
        at = f"head {self.after}" if self.after == self.head else f"{self.after} (head is {self.head})"
        if not self.changed:
            return f"kstore tables already at {at}: nothing to do"
        if self.before is None:
            return f"kstore tables created: migrated from none to {at}"
        return f"kstore tables migrated from {self.before} to {at}"


def upgrade(settings: Settings, revision: str = "head") -> Migration:
    """Create or upgrade kstore's tables to ``revision`` (default: the latest), saying from where to where.

    Uses its own version table (``kstore_alembic_version``), so it never touches an
    application's own Alembic history.
    """
    engine = make_engine(settings)
    cfg = alembic_config(settings)
    try:
        head = ScriptDirectory.from_config(cfg).get_current_head() or "base"
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            before = _current(conn, settings)
            command.upgrade(cfg, revision)
        return Migration(before, current_revision(engine, settings) or "base", head)
    except SQLAlchemyError as exc:
        raise DatabaseError(f"cannot migrate {settings.safe_dsn}: {first_line(exc)}") from None
    except CommandError as exc:
        raise ConfigurationError(f"cannot migrate to {revision!r}: {exc}") from None
    finally:
        engine.dispose()


def migrate(settings: Settings, revision: str = "head") -> str:
    """Create or upgrade kstore's tables in the database to ``revision`` (default: the latest).

    Uses its own version table (``kstore_alembic_version``), so it never
    touches an application's own Alembic history. Returns the revision reached
    (:func:`upgrade` says from where, too).
    """
    return upgrade(settings, revision).after


def current_revision(engine: Engine, settings: Settings) -> str | None:
    with engine.connect() as conn:
        return _current(conn, settings)


def _current(conn: Connection, settings: Settings) -> str | None:
    ctx = MigrationContext.configure(
        conn, opts={"version_table": f"{settings.table_prefix}alembic_version",
                    "version_table_schema": settings.schema},
    )
    return ctx.get_current_revision()


def check_migrated(engine: Engine, settings: Settings) -> None:
    """Raise :class:`NotMigratedError` unless kstore's tables are at the latest migration."""
    head = ScriptDirectory.from_config(alembic_config(settings)).get_current_head()
    try:
        current = current_revision(engine, settings)
    except SQLAlchemyError as exc:
        raise DatabaseError(
            f"cannot connect to database {settings.safe_dsn}: {first_line(exc)}"
        ) from None
    if current != head:
        state = "has no kstore tables" if current is None else f"is at migration {current}, need {head}"
        raise NotMigratedError(
            f"database {settings.safe_dsn} {state}: run `kstore migrate --dsn ...` first"
        )
