"""The ``kstore`` command: parses arguments, builds Settings, calls the library.

No SQL and no Kafka here. A :class:`KstoreError` is printed on one line and
exits non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

import click

from kstore.db import deadletters
from kstore.db.migration import migrate as migrate_db
from kstore.engine.worker import Worker
from kstore.errors import KstoreError
from kstore.kafkaoptions import SASL_MECHANISM_NAMES, SECURITY_PROTOCOLS
from kstore.ops import offsets as offsets_admin
from kstore.ops import replay as replays
from kstore.processor import load_processor
from kstore.settings import Settings

log = logging.getLogger("kstore.cli")



def dsn_option(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--dsn-file", default=None, metavar="PATH",
                     help="Read the database URL from this file (keeps its password out of the process list) "
                          "[env KSTORE_DSN_FILE]")(f)
    return click.option("--dsn", default=None, help="Database URL [env KSTORE_DSN; default sqlite:///kstore.db]")(f)


def _parse_kafka_options(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"expected NAME=VALUE, got {item!r}")
        options[name.strip()] = value
    return options


def kafka_connection_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """How to reach the brokers: address, TLS, SASL and any other kafka-python option."""
    for decorator in reversed([
        click.option("--bootstrap-servers", default=None,
                     help="Kafka brokers, HOST:PORT[,...] [env KSTORE_BOOTSTRAP_SERVERS]"),
        click.option("--security-protocol", default=None, type=click.Choice(SECURITY_PROTOCOLS, case_sensitive=False),
                     help="[env KSTORE_SECURITY_PROTOCOL; default PLAINTEXT]"),
        click.option("--sasl-mechanism", default=None,
                     help=f"With SASL_*: {', '.join(SASL_MECHANISM_NAMES)} [env KSTORE_SASL_MECHANISM]"),
        click.option("--sasl-username", default=None, help="[env KSTORE_SASL_USERNAME]"),
        click.option("--sasl-password-file", default=None, metavar="PATH",
                     help="Read the SASL password from this file [env KSTORE_SASL_PASSWORD_FILE, "
                          "or KSTORE_SASL_PASSWORD]"),
        click.option("--sasl-oauth-token-provider", default=None, metavar="MODULE:CALLABLE",
                     help="OAUTHBEARER: returns the current token [env KSTORE_SASL_OAUTH_TOKEN_PROVIDER]"),
        click.option("--ssl-cafile", default=None, metavar="PATH",
                     help="CA certificate(s) of the brokers, PEM [env KSTORE_SSL_CAFILE; default: the system's]"),
        click.option("--ssl-certfile", default=None, metavar="PATH",
                     help="Client certificate for mutual TLS, PEM [env KSTORE_SSL_CERTFILE]"),
        click.option("--ssl-keyfile", default=None, metavar="PATH",
                     help="Its private key, PEM [env KSTORE_SSL_KEYFILE]"),
        click.option("--ssl-key-password-file", default=None, metavar="PATH",
                     help="Read the key's password from this file [env KSTORE_SSL_KEY_PASSWORD_FILE]"),
        click.option("--ssl-check-hostname/--no-ssl-check-hostname", default=None,
                     help="Check the broker certificate's host name [env KSTORE_SSL_CHECK_HOSTNAME; default on]"),
        click.option("--kafka-option", "kafka_options", multiple=True, metavar="NAME=VALUE",
                     callback=_parse_kafka_options,
                     help="Any other kafka-python consumer option, repeatable [env KSTORE_KAFKA_<NAME>]"),
    ]):
        f = decorator(f)
    return f


@click.group()
@click.version_option(package_name="kstore", prog_name="kstore", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, default=False, help="Show tracebacks and debug logs.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              envvar="KSTORE_LOG_FORMAT",
              help="json: one JSON object a line (time, level, logger, message, group, and topic/partition/offset "
                   "where one message is concerned) [env KSTORE_LOG_FORMAT]")
@click.pass_context
def cli(ctx: click.Context, debug: bool, log_level: str, log_format: str) -> None:
    """kstore: exactly-once Kafka pipelines writing to a SQL database."""
    debug = debug or os.environ.get("KSTORE_DEBUG", "") not in ("", "0")
    ctx.obj = {"debug": debug}
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_json_formatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(LOG_CONTEXT)
    logging.basicConfig(level=logging.DEBUG if debug else getattr(logging, log_level.upper()), handlers=[handler])
    if not debug:
        # kafka-python logs every failed connection attempt as an ERROR; kstore
        # reports what matters itself (and everything shows with --debug).
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
        logging.getLogger("alembic").setLevel(logging.WARNING)


class _LogContext(logging.Filter):
    """Adds the pipeline's group to every log record (a field of its own in JSON logs)."""

    group: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.group is not None and not hasattr(record, "group"):
            record.group = self.group
        return True


LOG_CONTEXT = _LogContext()


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})


def _run(ctx: click.Context, settings_factory: Callable[[], Settings], action: Callable[[Settings], Any]) -> Any:
    """Build settings and call the library, turning KstoreError into one line on stderr."""
    settings: Settings | None = None
    try:
        settings = settings_factory()
        _hide_in_logs(settings.secrets)
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
    """Belt and braces: never print a secret, even if a driver put it in a message."""
    line = " ".join(message.splitlines())
    for secret in settings.secrets if settings is not None else ():
        line = line.replace(secret, "***")
    return line


class _HideSecrets(logging.Filter):
    """Masks the settings' secrets in every log record (kstore's, the drivers', with --debug too)."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        hidden = text
        for secret in self.secrets:
            hidden = hidden.replace(secret, "***")
            if record.exc_text:
                record.exc_text = record.exc_text.replace(secret, "***")
        if hidden != text:
            record.msg, record.args = hidden, None
        return True


def _hide_in_logs(secrets: list[str]) -> None:
    if secrets:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_HideSecrets(secrets))


@cli.command()
@dsn_option
@click.option("--revision", default="head", show_default=True, help="Migrate to this revision.")
@click.pass_context
def migrate(ctx: click.Context, dsn: str | None, dsn_file: str | None, revision: str) -> None:
    """Create or upgrade kstore's tables (its own Alembic history, kstore_alembic_version)."""
    revision = _run(ctx, lambda: Settings.from_env(dsn=dsn, dsn_file=dsn_file), lambda s: migrate_db(s, revision))
    click.echo(f"kstore tables are at migration {revision}")


@cli.command()
@click.argument("processor")
@dsn_option
@kafka_connection_options
@click.option("--group", default=None, help="Pipeline name (Kafka group id); overrides the processor's.")
@click.option("--topic", "topics", multiple=True, help="Topic to consume (repeatable); overrides the processor's.")
@click.option("--start-from", default=None, help="earliest, latest or ISO 8601 time, if no stored offset.")
@click.option("--max-batch-size", type=int, default=None, help="Most messages per transaction.")
@click.option("--on-error", type=click.Choice(["stop", "dead_letter"]), default=None,
              help="After the last attempt: stop, or dead-letter the message; overrides the processor's.")
@click.option("--max-attempts", type=int, default=None, help="Attempts per failing message; overrides the processor's.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve /metrics, /livez and /readyz on this port [env KSTORE_METRICS_PORT; default off]")
@click.pass_context
def worker(ctx: click.Context, /, processor: str, **options: Any) -> None:
    """Run PROCESSOR (MODULE:CLASS) until SIGTERM/SIGINT, exactly once."""
    topics = options.pop("topics")

    def start(settings: Settings) -> None:
        sys.path.insert(0, os.getcwd())
        w = Worker(load_processor(processor), settings)
        LOG_CONTEXT.group = w.group
        _run_worker(w, settings.shutdown_timeout_s)

    _run(ctx, lambda: Settings.from_env(topics=tuple(topics) or None, **options), start)


@cli.group()
def offsets() -> None:
    """See where a pipeline stands and move it (replay, skip, start at the end)."""


def _kafka_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = kafka_connection_options(f)
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
    rows = _run(ctx, lambda: Settings.from_env(**opts), lambda s: offsets_admin.show_offsets(s, group, topic))
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
                lambda s: offsets_admin.set_offsets(s, group, topic, partitions or None, **params))
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
                    **db: Any) -> None:
    """Every reset of a group, newest first: when, who, from, to, why, and the request id that wrote it."""
    rows = _run(ctx, lambda: Settings.from_env(**db), lambda s: offsets_admin.offset_history(s, group, topic, limit))
    if as_json:
        click.echo(json.dumps([{**dataclasses.asdict(r), "at": r.at.isoformat()} for r in rows], indent=2))
        return
    click.echo(_table(["AT", "TOPIC", "PARTITION", "FROM", "TO", "EPOCH", "BY", "REQUEST", "REASON"],
                      [[r.at.strftime("%Y-%m-%d %H:%M:%S"), r.topic, r.partition_id, r.from_offset, r.to_offset,
                        r.epoch, f"{r.by_user}@{r.by_host}", r.request_id, r.reason] for r in rows]))


@cli.group("dead-letters")
def dead_letters() -> None:
    """Messages that failed every attempt: list, show, replay (edited if need be), discard, resolve."""


@dead_letters.command("list")
@dsn_option
@click.option("--group", required=True)
@click.option("--all", "show_all", is_flag=True, help="Every status: replayed, discarded, resolved too.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def dead_letters_list(ctx: click.Context, /, group: str, show_all: bool, as_json: bool, **db: Any) -> None:
    """The group's dead letters waiting (status dead), or every one with --all."""
    status = None if show_all else deadletters.DEAD
    letters = _run(ctx, lambda: Settings.from_env(**db), lambda s: deadletters.list_dead_letters(s, group, status))
    if as_json:
        click.echo(json.dumps([d.summary() for d in letters], indent=2))
        return
    click.echo(_table(["ID", "TOPIC", "PARTITION", "OFFSET", "ATTEMPTS", "LAST_FAILURE", "STATUS", "ERROR"],
                      [[d.id, d.topic, d.partition_id, d.offset, d.attempts,
                        d.last_failure_at.strftime("%Y-%m-%d %H:%M:%S"), d.status, d.error[:80]] for d in letters]))


@dead_letters.command("show")
@dsn_option
@click.argument("dead_letter_id", type=int)
@click.pass_context
def dead_letters_show(ctx: click.Context, /, dead_letter_id: int, **db: Any) -> None:
    """One dead letter in full: the message, the error, its history (who changed it, when, why) and traceback."""
    d, changes = _run(ctx, lambda: Settings.from_env(**db), lambda s: deadletters.show_dead_letter(s, dead_letter_id))
    for name, value in d.summary().items():
        click.echo(f"{name}: {value}")
    click.echo(f"key: {d.key!r}\nvalue: {d.value!r}\nheaders: {list(d.headers)!r}")
    click.echo("history:" if changes else "history: none (waiting since it was dead-lettered)")
    for c in changes:
        click.echo(f"  {c.at:%Y-%m-%d %H:%M:%S}  {c.from_status} -> {c.to_status}  by {c.by}  "
                   f"request {c.request_id}  reason: {c.reason or '-'}")
        if c.edited:
            click.echo(f"    replayed edited: key {c.replayed_key!r} value {c.replayed_value!r}")
    click.echo(f"traceback:\n{d.traceback}")


@dead_letters.command("replay")
@click.argument("processor")
@dsn_option
@click.option("--group", required=True)
@click.option("--id", "ids", type=int, multiple=True, help="Only these (repeatable); default: all not yet replayed.")
@click.option("--value", default=None, help="Replay with this value instead (UTF-8); needs exactly one --id.")
@click.option("--value-file", default=None, metavar="PATH",
              help="Replay with this file's bytes as the value; needs exactly one --id.")
@click.option("--key", default=None, help="Replay with this key instead (UTF-8); needs exactly one --id.")
@click.option("--reason", default=None, help="Recorded in the dead letter's history.")
@click.pass_context
def dead_letters_replay(ctx: click.Context, /, processor: str, group: str, ids: tuple[int, ...], value: str | None,
                        value_file: str | None, key: str | None, reason: str | None, **db: Any) -> None:
    """Run dead letters through PROCESSOR again; each is marked replayed in the transaction of its effects.

    With --value, --value-file or --key the processor gets the edited message; the dead letter
    keeps the original, and its history the edited one.
    """
    def replay(s: Settings) -> replays.ReplayResult:
        edits = replays.edits_from_options(ids, key, value, value_file)
        sys.path.insert(0, os.getcwd())
        return replays.replay_dead_letters(s, load_processor(processor), group, ids or None, edits, reason)

    result = _run(ctx, lambda: Settings.from_env(**db), replay)
    click.echo(f"replayed {len(result.replayed)}, skipped {len(result.skipped)} (already replayed or not "
               f"of {group!r}), failed {len(result.failed)}")
    for letter_id, error in result.failed.items():
        click.echo(f"dead letter {letter_id} failed again: {error}", err=True)
    if result.failed:
        ctx.exit(1)


def _close_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--reason", required=True, help="Why; recorded with who and when in the history.")(f)
    f = click.option("--id", "ids", type=int, multiple=True, required=True, help="Repeatable.")(f)
    f = click.option("--group", required=True)(f)
    return dsn_option(f)


def _echo_closed(done: deadletters.StatusChange) -> None:
    if done.changed:
        click.echo(f"{done.status} {len(done.changed)}: {', '.join(map(str, done.changed))} "
                   f"(request {done.request_id})")
    if done.already:
        click.echo(f"already {done.status}, left as they were: {', '.join(map(str, done.already))}")


@dead_letters.command("discard")
@_close_options
@click.pass_context
def dead_letters_discard(ctx: click.Context, /, group: str, ids: tuple[int, ...], reason: str, **db: Any) -> None:
    """Drop waiting dead letters on purpose (status discarded), all or none, recording who, when and why."""
    _echo_closed(_run(ctx, lambda: Settings.from_env(**db),
                      lambda s: deadletters.discard_dead_letters(s, group, ids, reason)))


@dead_letters.command("resolve")
@_close_options
@click.pass_context
def dead_letters_resolve(ctx: click.Context, /, group: str, ids: tuple[int, ...], reason: str, **db: Any) -> None:
    """Mark waiting dead letters fixed by hand elsewhere (status resolved), all or none, with who, when and why."""
    _echo_closed(_run(ctx, lambda: Settings.from_env(**db),
                      lambda s: deadletters.resolve_dead_letters(s, group, ids, reason)))


def _stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop``: the loop ends after what it is doing, and the command exits 0."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop())


@cli.command()
@dsn_option
@kafka_connection_options
@click.option("--group", "groups", multiple=True, required=True, help="A pipeline (Kafka group id); repeatable.")
@click.option("--port", type=int, required=True, help="Serve /metrics on this port (0: any free port, logged).")
@click.option("--address", default="0.0.0.0", show_default=True, help="Listen on this address.")
@click.pass_context
def exporter(ctx: click.Context, /, groups: tuple[str, ...], port: int, address: str, **opts: Any) -> None:
    """Serve the lag of groups as Prometheus metrics on /metrics, no worker needed, until SIGTERM/SIGINT."""
    from kstore.ops.exporter import Exporter

    def serve(settings: Settings) -> None:
        server = Exporter(settings, groups, port, address)
        _stop_on_signals(server.request_stop)
        server.run()

    _run(ctx, lambda: Settings.from_env(**opts), serve)


@cli.command()
@_kafka_options
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit (an unreadable group: one line, exit 2).")
@click.pass_context
def top(ctx: click.Context, /, group: str, interval: float, once: bool, **opts: Any) -> None:
    """A live view of a group's partitions: offsets, lag, owner, epoch, throughput, dead letters."""
    from kstore.ops.top import Top

    def watch(settings: Settings) -> None:
        view = Top(settings, group, interval)
        if once:
            view.print_once()
            return
        _stop_on_signals(view.request_stop)
        view.run()

    _run(ctx, lambda: Settings.from_env(**opts), watch)


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


class _ShutdownTimeout(BaseException):
    """Raised in the main thread when the batch in flight outlives ``shutdown_timeout_s``.

    A BaseException, so that no ``except Exception`` (the processor's or kstore's)
    swallows it: it unwinds the batch, whose transaction rolls back.
    """


class _ForcedExit(BaseException):
    """Raised in the main thread by a second SIGTERM/SIGINT."""


def _install_signals(w: Worker, timeout_s: float) -> None:
    """First SIGTERM/SIGINT: finish the batch in flight (for at most ``timeout_s``), commit it, leave.
    Second: stop at once; the batch in flight rolls back, nothing partial is committed."""
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        if len(received) > 1:
            raise _ForcedExit(128 + signum)
        log.info("%s received: finishing the batch in flight (at most %gs), then leaving the group",
                 signal.Signals(signum).name, timeout_s)
        w.request_stop()
        # Then every second: a batch that starts after the first alarm (or is between
        # statements then) is still bounded.
        signal.setitimer(signal.ITIMER_REAL, timeout_s, 1.0)

    def on_alarm(_signum: int, _frame: Any) -> None:
        if w.busy:  # otherwise the loop is already on its way out: let it leave the group cleanly
            raise _ShutdownTimeout()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGALRM, on_alarm)


def _run_worker(w: Worker, timeout_s: float) -> None:
    _install_signals(w, timeout_s)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: for a worker that seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        w.run()
    except _ShutdownTimeout:
        log.warning("the batch in flight did not finish within %gs of the stop signal: rolled back, "
                    "it will be processed again after a restart", timeout_s)
    except _ForcedExit as exc:
        log.warning("second stop signal: stopped at once; the batch in flight was rolled back")
        sys.exit(exc.args[0])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kstore`` command: a usage error is one line on stderr and exit 2."""
    try:
        code = cli.main(args=argv, prog_name="kstore", standalone_mode=False)
    except click.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        click.echo(f"kstore: error: {exc.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
