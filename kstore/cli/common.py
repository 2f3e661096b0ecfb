"""What every ``kstore`` command shares: the options that build :class:`~kstore.settings.Settings`,
running one library call with a KstoreError as one line and an exit code, and keeping credentials
out of what is printed and logged (:mod:`kstore.ops.masking`).

Each command group (:mod:`kstore.cli.worker`, :mod:`kstore.cli.migrate`, :mod:`kstore.cli.ops`,
:mod:`kstore.cli.letters`) builds on this; :mod:`kstore.cli.command` puts them under the ``kstore``
command. No SQL and no Kafka here, nor in the groups: they parse
arguments, build Settings and call one library function.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

import click

from kstore.errors import KstoreError
from kstore.kafka.options import KAFKA_CLIENTS, SASL_MECHANISM_NAMES, SECURITY_PROTOCOLS
from kstore.ops.masking import Masker
from kstore.settings import Settings

#: The commands' own log lines (a stop signal, a rolled back batch): one logger for the whole command.
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
        click.option("--kafka-client", default=None, type=click.Choice(KAFKA_CLIENTS, case_sensitive=False),
                     help="The worker's Kafka consumer [env KSTORE_KAFKA_CLIENT; default confluent]"),
        click.option("--kafka-option", "kafka_options", multiple=True, metavar="NAME=VALUE",
                     callback=_parse_kafka_options,
                     help="Any other consumer option of the Kafka client (kafka-python's, or librdkafka's "
                          "with --kafka-client confluent), repeatable [env KSTORE_KAFKA_<NAME>]"),
    ]):
        f = decorator(f)
    return f


def schema_registry_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """How to reach the schema registry (the formats avro, protobuf and json-schema)."""
    for decorator in reversed([
        click.option("--schema-registry-url", default=None, metavar="URL",
                     help="Schema registry (Confluent's API), http(s)://HOST:PORT[/PATH][,...] "
                          "[env KSTORE_SCHEMA_REGISTRY_URL]"),
        click.option("--schema-registry-username", default=None,
                     help="HTTP basic auth user (Confluent Cloud: the API key) [env KSTORE_SCHEMA_REGISTRY_USERNAME]"),
        click.option("--schema-registry-password-file", default=None, metavar="PATH",
                     help="Read its password from this file [env KSTORE_SCHEMA_REGISTRY_PASSWORD_FILE, or "
                          "KSTORE_SCHEMA_REGISTRY_PASSWORD]"),
        click.option("--schema-registry-cafile", default=None, metavar="PATH",
                     help="CA certificate(s) of the registry, PEM [env KSTORE_SCHEMA_REGISTRY_CAFILE]"),
        click.option("--schema-registry-certfile", default=None, metavar="PATH",
                     help="Client certificate for mutual TLS, PEM [env KSTORE_SCHEMA_REGISTRY_CERTFILE]"),
        click.option("--schema-registry-keyfile", default=None, metavar="PATH",
                     help="Its private key, PEM [env KSTORE_SCHEMA_REGISTRY_KEYFILE]"),
    ]):
        f = decorator(f)
    return f


def group_connection_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--group`` (required), the database and the brokers: a command that reads one group from both."""
    f = kafka_connection_options(f)
    f = dsn_option(f)
    f = click.option("--group", required=True, help="Pipeline name (Kafka group id).")(f)
    return f


class _LogContext(logging.Filter):
    """Adds the pipeline's group to every log record (a field of its own in JSON logs)."""

    group: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.group is not None and not hasattr(record, "group"):
            record.group = self.group
        return True


#: Installed on the ``kstore`` command's log handler; ``kstore worker`` sets its group.
LOG_CONTEXT = _LogContext()


def run(ctx: click.Context, settings_factory: Callable[[], Settings], action: Callable[[Settings], Any]) -> Any:
    """Build settings and call the library, turning KstoreError into one line on stderr."""
    masker = Masker()
    try:
        settings = settings_factory()
        masker = Masker(settings.secrets)
        _mask_logs(masker)
        return action(settings)
    except KstoreError as exc:
        _fail(ctx, masker, f"kstore: error: {exc}", exc.exit_code)
    except Exception as exc:  # the last line of defence for a clean message
        _fail(ctx, masker, f"kstore: unexpected error: {type(exc).__name__}: {exc} (rerun with --debug)", 1)


def _fail(ctx: click.Context, masker: Masker, message: str, code: int) -> NoReturn:
    if ctx.obj["debug"]:
        log.exception("failed")
    # kstore's own messages hold no secret; a driver's text inside one might (see kstore.ops.masking).
    click.echo(masker.mask(" ".join(message.splitlines())), err=True)
    ctx.exit(code)
    raise AssertionError("unreachable")


class _MaskLogs(logging.Filter):
    """Masks the credentials in every log record (kstore's, the drivers', tracebacks with --debug)."""

    def __init__(self, masker: Masker) -> None:
        super().__init__()
        self.masker = masker

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.masker.mask(record.exc_text)
        text = record.getMessage()
        masked = self.masker.mask(text)
        if masked != text:
            record.msg, record.args = masked, None
        return True


def _mask_logs(masker: Masker) -> None:
    """One masking filter on each handler of the root logger (replacing an earlier command's, in-process)."""
    for handler in logging.getLogger().handlers:
        for earlier in [f for f in handler.filters if isinstance(f, _MaskLogs)]:
            handler.removeFilter(earlier)
        handler.addFilter(_MaskLogs(masker))


def stop_on_signals(stop: Callable[[], None], stopping: str | None = None) -> None:
    """SIGTERM and SIGINT call ``stop``: the loop ends after what it is doing, and the command exits 0.
    ``stopping`` (what the stop does) is logged first, after the signal's name, as the worker's stop is."""

    def on_signal(signum: int, _frame: Any) -> None:
        if stopping is not None:
            log.info("%s received: %s", signal.Signals(signum).name, stopping)
        stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)


def iso_time(raw: str) -> datetime:
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"not an ISO 8601 time: {raw!r}") from None
    if when.tzinfo is None:
        raise click.BadParameter(f"give a timezone, e.g. {raw}+00:00 or {raw}Z")
    return when


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells)
