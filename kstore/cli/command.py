"""The ``kstore`` group: logging, ``--debug``, the subcommands, and :func:`main` (the console script).

``kstore worker`` and ``relay`` are :mod:`kstore.cli.worker`, ``kstore migrate``
:mod:`kstore.cli.migrate`, ``kstore offsets``, ``outbox``, ``exporter``, ``top`` and ``topics``
:mod:`kstore.cli.ops`, ``kstore dead-letters`` :mod:`kstore.cli.letters`, ``kstore console``
:mod:`kstore.cli.web`; what they share (options, one-line errors, secrets kept out of output) is
:mod:`kstore.cli.common`.
No SQL and no Kafka here. A :class:`KstoreError` is printed on one line and exits non-zero;
``--debug`` shows the traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from kstore import __version__
from kstore.cli.common import LOG_CONTEXT
from kstore.cli.migrate import migrate
from kstore.cli.ops import dead_letters, exporter, offsets, outbox, top, topics
from kstore.cli.web import console
from kstore.cli.worker import relay, worker


@click.group()
@click.version_option(__version__, prog_name="kstore", message="%(prog)s %(version)s")
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
        # The schema registry's HTTP client logs every request at INFO (their URLs, never their answers):
        # kstore says what matters of the registry itself.
        for name in ("httpx", "httpx2", "httpcore", "httpcore2"):
            logging.getLogger(name).setLevel(logging.WARNING)


for command in (migrate, worker, relay, offsets, dead_letters, outbox, exporter, top, topics, console):
    cli.add_command(command)


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})


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
