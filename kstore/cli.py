"""The ``kstore`` command: parses arguments, builds Settings, calls the library.

No SQL and no Kafka here. A :class:`KstoreError` is printed on one line and
exits non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from .errors import KstoreError
from .migration import migrate as migrate_db
from .settings import Settings
from .worker import Worker, load_processor

log = logging.getLogger("kstore.cli")

dsn_option = click.option("--dsn", default=None, help="Database URL [env KSTORE_DSN; default sqlite:///kstore.db]")


@click.group()
@click.option("--debug", is_flag=True, default=False, help="Show tracebacks and debug logs.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.pass_context
def main(ctx: click.Context, debug: bool, log_level: str) -> None:
    """kstore: exactly-once Kafka pipelines writing to a SQL database."""
    debug = debug or os.environ.get("KSTORE_DEBUG", "") not in ("", "0")
    ctx.obj = {"debug": debug}
    logging.basicConfig(
        level=logging.DEBUG if debug else getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not debug:
        # kafka-python logs every failed connection attempt as an ERROR; kstore
        # reports what matters itself (and everything shows with --debug).
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
        logging.getLogger("alembic").setLevel(logging.WARNING)


def _run(ctx: click.Context, settings_factory: Callable[[], Settings], action: Callable[[Settings], Any]) -> Any:
    """Build settings and call the library, turning KstoreError into one line on stderr."""
    settings: Settings | None = None
    try:
        settings = settings_factory()
        return action(settings)
    except KstoreError as exc:
        _fail(ctx, settings, f"kstore: error: {exc}", exc.exit_code)
    except Exception as exc:  # the last line of defence for a clean message
        _fail(ctx, settings, f"kstore: unexpected error: {type(exc).__name__}: {exc} (rerun with --debug)", 1)


def _fail(ctx: click.Context, settings: Settings | None, message: str, code: int) -> NoReturn:
    if ctx.obj["debug"]:
        log.exception("failed")
    click.echo(_scrub(message, settings), err=True)
    ctx.exit(code)
    raise AssertionError("unreachable")


def _scrub(message: str, settings: Settings | None) -> str:
    """Belt and braces: never print a password, even if a driver put it in a message."""
    line = " ".join(message.splitlines())
    if settings is not None:
        from sqlalchemy.engine import make_url

        password = make_url(settings.dsn).password
        if password:
            line = line.replace(str(password), "***")
    return line


@main.command()
@dsn_option
@click.pass_context
def migrate(ctx: click.Context, dsn: str | None) -> None:
    """Create or upgrade kstore's tables (its own Alembic history, kstore_alembic_version)."""
    revision = _run(ctx, lambda: Settings.from_env(dsn=dsn), migrate_db)
    click.echo(f"kstore tables are at migration {revision}")


@main.command()
@click.argument("processor")
@dsn_option
@click.option("--bootstrap-servers", default=None, help="Kafka brokers, HOST:PORT[,...] [env KSTORE_BOOTSTRAP_SERVERS]")
@click.option("--group", default=None, help="Pipeline name (Kafka group id); overrides the processor's.")
@click.option("--topic", "topics", multiple=True, help="Topic to consume (repeatable); overrides the processor's.")
@click.option("--start-from", default=None, help="earliest, latest or ISO 8601 time, if no stored offset.")
@click.option("--max-batch-size", type=int, default=None, help="Most messages per transaction.")
@click.pass_context
def worker(ctx: click.Context, /, processor: str, **options: Any) -> None:
    """Run PROCESSOR (MODULE:CLASS) until SIGTERM/SIGINT, exactly once."""
    topics = options.pop("topics")

    def start(settings: Settings) -> None:
        sys.path.insert(0, os.getcwd())
        w = Worker(load_processor(processor), settings)
        _install_signals(w)
        w.run()

    _run(ctx, lambda: Settings.from_env(topics=tuple(topics) or None, **options), start)


def _install_signals(w: Worker) -> None:
    """First SIGTERM/SIGINT: finish the batch in flight and leave. Second: stop now, committing nothing more."""
    received = []

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:
            log.info("%s received: finishing the batch in flight, then leaving the group",
                     signal.Signals(signum).name)
            w.request_stop()
            return
        # Raised in the main thread wherever it is: the open transaction rolls back.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


if __name__ == "__main__":
    main()
