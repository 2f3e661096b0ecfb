"""The ``kstore`` command: parses arguments, builds Settings, calls the library.

No SQL and no Kafka here. A :class:`KstoreError` is printed on one line and
exits non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

import click

from . import admin
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


@main.group()
def offsets() -> None:
    """See where a pipeline stands and move it (replay, skip, start at the end)."""


def _kafka_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--bootstrap-servers", default=None, help="Kafka brokers [env KSTORE_BOOTSTRAP_SERVERS]")(f)
    f = dsn_option(f)
    f = click.option("--group", required=True, help="Pipeline name (Kafka group id).")(f)
    return f


@offsets.command("show")
@_kafka_options
@click.option("--topic", default=None, help="Only this topic (default: every topic the group has offsets for).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def offsets_show(ctx: click.Context, /, group: str, topic: str | None, as_json: bool, **opts: Any) -> None:
    """Stored offset, log start and end, lag, epoch, last update and live owner of each partition."""
    rows = _run(ctx, lambda: Settings.from_env(**opts), lambda s: admin.show_offsets(s, group, topic))
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    click.echo(_table(["TOPIC", "PARTITION", "NEXT_OFFSET", "LOG_START", "LOG_END", "LAG", "EPOCH", "UPDATED", "OWNER"],
                      [[r.topic, r.partition, r.next_offset, r.log_start, r.log_end, r.lag, r.epoch,
                        r.updated_at.strftime("%Y-%m-%d %H:%M:%S") if r.updated_at else None, r.owner]
                       for r in rows]))


@offsets.command("set")
@_kafka_options
@click.option("--topic", required=True)
@click.option("--partition", "partitions", type=int, multiple=True, help="Repeatable; default: every partition.")
@click.option("--to-offset", type=int, default=None)
@click.option("--to-datetime", default=None, callback=lambda _c, _p, v: None if v is None else _iso_time(v),
              help="ISO 8601 with a timezone, e.g. 2026-11-30T08:00:00Z")
@click.option("--to-earliest", is_flag=True)
@click.option("--to-latest", is_flag=True)
@click.option("--shift-by", type=int, default=None, help="Move by N from the stored offset (negative: replay).")
@click.option("--clamp", is_flag=True, help="Move out-of-range targets to the nearest end instead of refusing.")
@click.option("--reason", default=None, help="Recorded in the reset history.")
@click.option("--execute", is_flag=True, help="Apply the plan; without it, only print it.")
@click.pass_context
def offsets_set(ctx: click.Context, /, group: str, topic: str, partitions: tuple[int, ...], **opts: Any) -> None:
    """Move a group's partitions on a topic; prints the plan, and applies it with --execute."""
    names = ("to_offset", "to_datetime", "to_earliest", "to_latest", "shift_by", "clamp", "reason", "execute")
    params = {k: opts.pop(k) for k in names}
    plan = _run(ctx, lambda: Settings.from_env(**opts),
                lambda s: admin.set_offsets(s, group, topic, partitions or None, **params))
    click.echo(_table(["TOPIC", "PARTITION", "FROM", "TO", "NOTE"],
                      [[p.topic, p.partition, p.from_offset, p.to_offset, p.note] for p in plan]))
    if params["execute"]:
        click.echo(f"applied: running workers of {group!r} pick it up within a few seconds")
    else:
        click.echo("dry run: nothing changed; add --execute to apply")


@offsets.command("history")
@dsn_option
@click.option("--group", required=True)
@click.option("--topic", default=None)
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def offsets_history(ctx: click.Context, /, group: str, topic: str | None, limit: int, as_json: bool,
                    dsn: str | None) -> None:
    """Every reset of a group, newest first: when, who, from, to, why."""
    rows = _run(ctx, lambda: Settings.from_env(dsn=dsn), lambda s: admin.offset_history(s, group, topic, limit))
    if as_json:
        click.echo(json.dumps([{**dataclasses.asdict(r), "at": r.at.isoformat()} for r in rows], indent=2))
        return
    click.echo(_table(["AT", "TOPIC", "PARTITION", "FROM", "TO", "EPOCH", "BY", "REASON"],
                      [[r.at.strftime("%Y-%m-%d %H:%M:%S"), r.topic, r.partition_id, r.from_offset, r.to_offset,
                        r.epoch, f"{r.by_user}@{r.by_host}", r.reason] for r in rows]))


def _iso_time(raw: str) -> datetime:
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"not an ISO 8601 time: {raw!r}") from None
    if when.tzinfo is None:
        raise click.BadParameter(f"give a timezone, e.g. {raw}+00:00 or {raw}Z")
    return when


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells)


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
