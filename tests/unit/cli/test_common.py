"""What every ``kstore`` command shares (kstore.cli.common), in process through click's runner: a
KstoreError is one line on stderr with its exit code, a driver's text in it has its password masked,
and the shared parsers (``--kafka-option``, ISO times, tables) refuse or lay out what they are given.
The commands as a user runs them, in a process of their own: tests/integration/cli/."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import click
import pytest
from click.testing import CliRunner

from kstore.cli import cli
from kstore.cli.common import iso_time, run, table
from kstore.errors import ConfigurationError
from kstore.settings import Settings


def test_a_kafka_option_without_a_value_is_refused_before_anything_runs() -> None:
    r = CliRunner().invoke(cli, ["worker", "processors:Recorder", "--kafka-option", "novalue", "--dsn", "sqlite://"])
    assert r.exit_code == 2
    assert "Invalid value for '--kafka-option': expected NAME=VALUE, got 'novalue'" in r.output


def test_a_kstore_error_is_one_line_with_its_exit_code_and_no_password() -> None:
    @click.command()
    @click.pass_context
    def fails(ctx: click.Context) -> None:
        ctx.obj = {"debug": False}

        def action(settings: Settings) -> None:
            raise ConfigurationError("cannot connect to postgresql://u:hunter2@db/app:\nconnection refused")

        run(ctx, lambda: Settings(dsn="postgresql://u:hunter2@db/app"), action)

    r = CliRunner().invoke(fails, [])
    assert r.exit_code == ConfigurationError.exit_code == 2
    assert r.output == "kstore: error: cannot connect to postgresql://u:***@db/app: connection refused\n"


def test_an_unexpected_error_says_so_and_how_to_see_more() -> None:
    @click.command()
    @click.pass_context
    def breaks(ctx: click.Context) -> None:
        ctx.obj = {"debug": False}
        run(ctx, Settings, lambda settings: {}["missing"])

    r = CliRunner().invoke(breaks, [])
    assert (r.exit_code, r.output) == (1, "kstore: unexpected error: KeyError: 'missing' (rerun with --debug)\n")


def test_an_iso_time_needs_its_timezone() -> None:
    assert iso_time("2026-12-01T12:00:00Z") == datetime(2026, 12, 1, 12, tzinfo=timezone.utc)
    assert iso_time("2026-12-01T12:00:00+02:00").utcoffset() == timedelta(hours=2)
    with pytest.raises(click.BadParameter, match=r"give a timezone, e\.g\. 2026-12-01T12:00\+00:00"):
        iso_time("2026-12-01T12:00")
    with pytest.raises(click.BadParameter, match="not an ISO 8601 time: 'yesterday'"):
        iso_time("yesterday")


def test_a_table_pads_its_columns_and_shows_none_as_a_dash() -> None:
    assert table(["group", "lag"], [["orders", 12], ["payments-eu", None]]).splitlines() == [
        "group        lag",
        "orders       12",
        "payments-eu  -",
    ]
