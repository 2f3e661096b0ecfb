"""``kstore console``: the web console (:mod:`kstore.console`), served until SIGTERM/SIGINT."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from kstore.cli.common import dsn_option, kafka_connection_options, log, run, schema_registry_options
from kstore.errors import ConfigurationError
from kstore.processor import Processor
from kstore.running.loading import load_processor
from kstore.settings import Settings


@click.command()
@dsn_option
@kafka_connection_options
@schema_registry_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Listen on this address (another than this host's own only behind a proxy you trust).")
@click.option("--port", type=int, default=8470, show_default=True, help="Listen on this port.")
@click.option("--read-only", "console_read_only", is_flag=True, default=None,
              help="Show, never act: no login asked for, every action refused [env KSTORE_CONSOLE_READ_ONLY]")
@click.option("--password-file", "console_password_file", default=None, metavar="PATH",
              help="Read the operators' password from this file [env KSTORE_CONSOLE_PASSWORD_FILE, or "
                   "KSTORE_CONSOLE_PASSWORD]")
@click.option("--user-header", "console_user_header", default=None, metavar="NAME",
              help="Take the operator's name from this request header, set by a proxy that authenticates "
                   "[env KSTORE_CONSOLE_USER_HEADER]")
@click.option("--trusted-proxy", "console_trusted_proxies", multiple=True, metavar="ADDR",
              help="A proxy (IP or network) whose X-Forwarded-For and -Proto headers are believed; repeatable. "
                   "Without one, no such header is [env KSTORE_CONSOLE_TRUSTED_PROXIES, comma-separated]")
@click.option("--secure-cookie", "console_secure_cookie", is_flag=True, default=None,
              help="Mark the cookies Secure even on plain HTTP, behind a TLS proxy that is not trusted "
                   "[env KSTORE_CONSOLE_SECURE_COOKIE]")
@click.option("--sample-interval", "console_sample_interval_s", type=click.FloatRange(min=0), default=None,
              help="Seconds between lag samples for the charts; 0: none [env KSTORE_CONSOLE_SAMPLE_INTERVAL_S; "
                   "default 15]")
@click.option("--processor", "processors", multiple=True, metavar="MODULE:CLASS",
              help="A group's processor (its group is the processor's), to replay its dead letters; repeatable.")
@click.pass_context
def console(ctx: click.Context, /, host: str, port: int, processors: tuple[str, ...], **opts: Any) -> None:
    """Serve the web console: overview, lag over time, dead letters, offsets and outbox, with actions."""
    # No --trusted-proxy is None, not (), so that KSTORE_CONSOLE_TRUSTED_PROXIES still counts.
    opts["console_trusted_proxies"] = opts["console_trusted_proxies"] or None

    def serve(settings: Settings) -> None:
        try:  # when the command runs: the other commands never need the console's extra
            import uvicorn

            from kstore.console import app
        except ImportError as exc:
            raise ConfigurationError(f"the console needs its extra: pip install 'kstore[console]' ({exc})") from None
        web = app(settings, _processors(settings, processors))
        log.info("kstore console on http://%s:%d/ (%s)", host, port,
                 "read-only" if settings.console_read_only else "log in to act")
        # uvicorn believes X-Forwarded-* from 127.0.0.1 (or FORWARDED_ALLOW_IPS) unless told otherwise, which
        # let any local client pick its own address and so escape the login throttle: only the proxies named
        # here are believed, and with none uvicorn's proxy middleware is not installed at all.
        trusted = list(settings.console_trusted_proxies)
        uvicorn.run(web, host=host, port=port, log_level="warning", access_log=False,
                    proxy_headers=bool(trusted), forwarded_allow_ips=trusted)

    run(ctx, lambda: Settings.from_env(**opts), serve)


def _processors(settings: Settings, paths: tuple[str, ...]) -> dict[str, Processor]:
    sys.path.insert(0, os.getcwd())
    found = {}
    for path in paths:
        processor = load_processor(path)
        group = settings.group or processor.group
        if not group:
            raise ConfigurationError(f"processor {path} names no group (its class attribute group)")
        found[group] = processor
    return found
