"""``kstore dead-letters``: list, show, replay, discard and resolve a group's dead letters.

Each subcommand parses its options, builds Settings and calls one function of
:mod:`kstore.db.deadletters`, :mod:`kstore.db.letterquery` or :mod:`kstore.ops.replay`, and prints
what it returned. ``--id`` names letters to act on at once; without it, the filters (the same for
every subcommand) say which, and ``replay``, ``discard`` and ``resolve`` only count them unless
given ``--execute``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from kstore.cli.common import dsn_option, group_connection_options, iso_time, run, schema_registry_options, table
from kstore.db import deadletters
from kstore.db.letterquery import (
    MAX_PAGE,
    LetterFilter,
    LetterPage,
    Span,
    Tally,
    discard_matching,
    list_dead_letters,
    plan_dead_letters,
    resolve_matching,
)
from kstore.errors import ConfigurationError
from kstore.ops import replay as replays
from kstore.running.loading import load_processor
from kstore.schemas import Registry, UnknownSchemaError, WireFormatError
from kstore.schemas.formats import decoded_for_display
from kstore.settings import Settings


@click.group("dead-letters")
def dead_letters() -> None:
    """Messages that failed every attempt: list, show, replay (edited if need be), discard, resolve."""


def _filter_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Which letters (``LetterFilter``): the same options for list, replay, discard and resolve."""
    when = "(ISO 8601 with a timezone, e.g. 2026-12-01T08:00:00Z)"
    for option in reversed([
        click.option("--topic", default=None, help="Only letters of this topic."),
        click.option("--partition", type=int, default=None, help="Only letters of this partition."),
        click.option("--error-type", default=None, metavar="NAME",
                     help="Only letters whose error is this exception class, e.g. ValueError."),
        click.option("--error", "error_text", default=None, metavar="TEXT",
                     help="Only letters whose error contains TEXT (in any case)."),
        click.option("--since", default=None, callback=_when, metavar="TIME",
                     help=f"Only letters last failed at or after this time {when}."),
        click.option("--until", default=None, callback=_when, metavar="TIME",
                     help=f"Only letters last failed before this time {when}."),
    ]):
        f = option(f)
    return f


def _when(_ctx: click.Context, _param: click.Parameter, raw: str | None) -> Any:
    return None if raw is None else iso_time(raw)


_FILTERS = ("topic", "partition", "error_type", "error_text", "since", "until")


def _where(opts: dict[str, Any], status: str | None = deadletters.DEAD) -> LetterFilter:
    """The filter the options ask for (taking them out of ``opts``); built inside ``run``, so a bad one is one line."""
    given = {k: opts.pop(k) for k in _FILTERS}
    return LetterFilter(status=status, topic=given["topic"], partition=given["partition"],
                        error_type=given["error_type"], error=given["error_text"], since=given["since"],
                        until=given["until"])


@dead_letters.command("list")
@dsn_option
@click.option("--group", required=True)
@_filter_options
@click.option("--status", type=click.Choice([*deadletters.STATUSES, "any"]), default=deadletters.DEAD,
              show_default=True, help="Only letters in this status; any: every status.")
@click.option("--all", "show_all", is_flag=True, help="Every status (--status any).")
@click.option("--limit", type=click.IntRange(1, MAX_PAGE), default=100, show_default=True,
              help="Letters on one page.")
@click.option("--after", type=click.IntRange(min=0), default=0, metavar="ID",
              help="Start after this id: the last id of the page before (the line after the page says it).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line instead of a table.")
@click.pass_context
def dead_letters_list(ctx: click.Context, /, group: str, status: str, show_all: bool, limit: int, after: int,
                      as_json: bool, **opts: Any) -> None:
    """A page of the group's dead letters by id (default: the waiting ones, status dead), filtered by topic,
    partition, error, time or status, with how many match and how many more there are (on stderr)."""
    wanted = None if show_all or status == "any" else status
    settings_opts = {k: v for k, v in opts.items() if k not in _FILTERS}
    page: LetterPage = run(ctx, lambda: Settings.from_env(**settings_opts),
                           lambda s: list_dead_letters(s, group, _where(opts, wanted), limit, after))
    if as_json:
        for d in page.letters:
            click.echo(json.dumps(d.summary()))
    else:
        click.echo(table(["ID", "TOPIC", "PARTITION", "OFFSET", "ATTEMPTS", "LAST_FAILURE", "STATUS", "ERROR"],
                         [[d.id, d.topic, d.partition_id, d.offset, d.attempts,
                           d.last_failure_at.strftime("%Y-%m-%d %H:%M:%S"), d.status, d.error[:80]]
                          for d in page.letters]))
    click.echo(_page_note(page, after), err=True)


def _page_note(page: LetterPage, after: int) -> str:
    """``100 of 1087 shown (ids 1..100); 987 more: add --after 100``."""
    if not page.letters:
        return f"none of {page.total} matching after id {after}" if page.total else "no dead letter matches"
    shown = f"{len(page.letters)} of {page.total} shown (ids {page.letters[0].id}..{page.letters[-1].id})"
    if page.next_after is None:
        return f"{shown}; no more"
    return f"{shown}; {page.more} more: add --after {page.next_after}"


@dead_letters.command("show")
@dsn_option
@schema_registry_options
@click.argument("dead_letter_id", type=int)
@click.option("--raw", is_flag=True, help="With a schema registry: also the key's and value's bytes as stored.")
@click.pass_context
def dead_letters_show(ctx: click.Context, /, dead_letter_id: int, raw: bool, **db: Any) -> None:
    """One dead letter in full: the message, the error, its history (who changed it, when, why) and traceback.

    With --schema-registry-url, a key or value in the registry's wire format (Avro, JSON Schema) is
    shown decoded with the schema it names."""
    def show(s: Settings) -> tuple[Any, Any, list[tuple[str, str]]]:
        d, changes = deadletters.show_dead_letter(s, dead_letter_id)
        return d, changes, _decoded(s, [("key", d.key), ("value", d.value)], raw)

    d, changes, fields = run(ctx, lambda: Settings.from_env(**db), show)
    for name, value in d.summary().items():
        click.echo(f"{name}: {value}")
    for name, text in fields:
        click.echo(f"{name}: {text}")
    click.echo(f"headers: {list(d.headers)!r}")
    click.echo("history:" if changes else "history: none (waiting since it was dead-lettered)")
    for c in changes:
        click.echo(f"  {c.at:%Y-%m-%d %H:%M:%S}  {c.from_status} -> {c.to_status}  by {c.by}  "
                   f"request {c.request_id}  reason: {c.reason or '-'}")
        if c.failed:
            click.echo("    the replay failed: the letter's error and attempts include it")
        if c.edited:
            ran = "ran" if c.failed else "replayed"
            click.echo(f"    {ran} edited: key {c.replayed_key!r} value {c.replayed_value!r}")
    click.echo(f"traceback:\n{d.traceback}")


def _decoded(settings: Settings, fields: list[tuple[str, bytes | None]], raw: bool) -> list[tuple[str, str]]:
    """Each field as shown: decoded with the schema it names (with a registry), else as stored."""
    if not settings.schema_registry_url:
        return [(name, repr(data)) for name, data in fields]
    registry = Registry.of(settings)
    shown = []
    for name, data in fields:
        try:
            found = decoded_for_display(registry, data)
        except (UnknownSchemaError, WireFormatError) as exc:
            found, data_note = None, f"  (not decoded: {exc})"
        else:
            data_note = ""
        if found is None:
            shown.append((name, f"{data!r}{data_note}"))
            continue
        described, value = found
        shown.append((name, f"({described}) {json.dumps(value, default=str)}"))
        if raw:
            shown.append((f"{name} bytes", repr(data)))
    return shown


@dead_letters.command("replay")
@click.argument("processor")
@group_connection_options
@schema_registry_options
@click.option("--id", "ids", type=int, multiple=True,
              help="Replay these at once (repeatable); without it, every waiting letter the filters match.")
@_filter_options
@click.option("--value", default=None, help="Replay with this value instead (UTF-8); needs exactly one --id.")
@click.option("--value-file", default=None, metavar="PATH",
              help="Replay with this file's bytes as the value; needs exactly one --id.")
@click.option("--key", default=None, help="Replay with this key instead (UTF-8); needs exactly one --id.")
@click.option("--reason", default=None, help="Recorded in the dead letter's history.")
@click.option("--execute", is_flag=True, help="Replay the letters the filters match; without it, only count them.")
@click.pass_context
def dead_letters_replay(ctx: click.Context, /, processor: str, group: str, ids: tuple[int, ...], value: str | None,
                        value_file: str | None, key: str | None, reason: str | None, execute: bool,
                        **opts: Any) -> None:
    """Run dead letters through PROCESSOR again; each is marked replayed in the transaction of its effects.

    With --id, those letters are replayed at once. Without it, every waiting letter the filters
    match (all, with none) is counted, and with --execute replayed, by id, a page at a time: a
    letter that fails again stays dead and the replay goes on past it. With --value, --value-file
    or --key (and one --id) the processor gets the edited message; the dead letter keeps the
    original, and its history the edited one. What the processor produces is checked against the
    brokers (--bootstrap-servers) as the worker checks it: a record for a topic the cluster lacks
    fails the replay instead of waiting in the outbox.
    """
    settings_opts = {k: v for k, v in opts.items() if k not in _FILTERS}

    def replay(s: Settings) -> replays.ReplayResult | Span | Tally:
        where = _by_id_or_filter(ids, opts)
        edits = replays.edits_from_options(ids, key, value, value_file)
        sys.path.insert(0, os.getcwd())
        proc = load_processor(processor)
        if ids:
            return replays.replay_dead_letters(s, proc, group, ids, edits, reason)
        if not execute:
            return plan_dead_letters(s, group, where)
        return replays.replay_matching(s, proc, group, where, reason)

    result = run(ctx, lambda: Settings.from_env(**settings_opts), replay)
    if isinstance(result, Span):
        _echo_plan("replay", group, result)
        return
    if isinstance(result, Tally):
        _echo_tally(result, group)
        failures = result.failures
    else:
        click.echo(f"replayed {len(result.replayed)}, skipped {len(result.skipped)} (already replayed or not "
                   f"of {group!r}), failed {len(result.failed)}")
        failures = result.failed
    for letter_id, error in failures.items():
        click.echo(f"dead letter {letter_id} failed again: {error}", err=True)
    if failures:
        ctx.exit(1)


def _by_id_or_filter(ids: tuple[int, ...], opts: dict[str, Any]) -> LetterFilter:
    where = _where(opts)
    if ids and where.narrows():
        raise ConfigurationError("give --id or filters (--topic, --partition, --error-type, --error, --since, "
                                 "--until), not both")
    return where


def _echo_plan(action: str, group: str, found: Span) -> None:
    if found.count:
        click.echo(f"would {action} {found.count} waiting dead letter(s) of {group!r} "
                   f"(ids {found.first_id}..{found.last_id})")
    else:
        click.echo(f"no waiting dead letter of {group!r} matches: nothing to {action}")
    click.echo(f"dry run: nothing changed; add --execute to {action} them")


def _echo_tally(done: Tally, group: str) -> None:
    """``replayed 850, failed 150, skipped 0, remaining 0 (ids 1..1000)``, and what is left to do."""
    past = {"replay": "replayed", "discard": "discarded", "resolve": "resolved"}[done.action]
    span = f" (ids {done.first_id}..{done.last_id})" if done.first_id is not None else ""
    failed = f", failed {done.failed}" if done.action == "replay" else ""
    click.echo(f"{past} {done.done}{failed}, skipped {done.skipped}, remaining {done.remaining}{span}")
    if done.failed > len(done.failures):
        click.echo(f"{done.failed - len(done.failures)} more failed again than listed below; they stay dead: "
                   f"kstore dead-letters list --group {group}", err=True)
    if done.remaining:
        click.echo(f"{done.remaining} matching letter(s) were dead-lettered after this command started: "
                   "run it again for them", err=True)


def _close_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--execute", is_flag=True,
                     help="Act on the letters the filters match; without it, only count them.")(f)
    f = _filter_options(f)
    f = click.option("--reason", default=None, help="Why; recorded with who and when in the history (required to "
                                                    "act).")(f)
    f = click.option("--id", "ids", type=int, multiple=True,
                     help="These at once, all or none (repeatable); without it, the letters the filters match.")(f)
    f = click.option("--group", required=True)(f)
    return dsn_option(f)


def _echo_closed(done: deadletters.StatusChange) -> None:
    if done.changed:
        click.echo(f"{done.status} {len(done.changed)}: {', '.join(map(str, done.changed))} "
                   f"(request {done.request_id})")
    if done.already:
        click.echo(f"already {done.status}, left as they were: {', '.join(map(str, done.already))}")


def _close(ctx: click.Context, status: str, group: str, ids: tuple[int, ...], reason: str | None, execute: bool,
           opts: dict[str, Any]) -> None:
    """``discard`` and ``resolve``: by id at once, or the letters the filters match (a dry run unless --execute)."""
    settings_opts = {k: v for k, v in opts.items() if k not in _FILTERS}
    by_id = deadletters.discard_dead_letters if status == deadletters.DISCARDED else deadletters.resolve_dead_letters
    matching = discard_matching if status == deadletters.DISCARDED else resolve_matching

    def close(s: Settings) -> deadletters.StatusChange | Span | Tally:
        where = _by_id_or_filter(ids, opts)
        if ids:
            return by_id(s, group, ids, reason or "")
        if not execute:
            return plan_dead_letters(s, group, where)
        return matching(s, group, where, reason or "")

    result = run(ctx, lambda: Settings.from_env(**settings_opts), close)
    if isinstance(result, Span):
        _echo_plan(deadletters.ACTIONS[status], group, result)
    elif isinstance(result, Tally):
        _echo_tally(result, group)
    else:
        _echo_closed(result)


@dead_letters.command("discard")
@_close_options
@click.pass_context
def dead_letters_discard(ctx: click.Context, /, group: str, ids: tuple[int, ...], reason: str | None, execute: bool,
                         **opts: Any) -> None:
    """Drop waiting dead letters on purpose (status discarded), recording who, when and why.

    With --id, those letters at once, all or none. Without it, every waiting letter the filters
    match (all, with none) is counted, and with --execute discarded, a page at a time.
    """
    _close(ctx, deadletters.DISCARDED, group, ids, reason, execute, opts)


@dead_letters.command("resolve")
@_close_options
@click.pass_context
def dead_letters_resolve(ctx: click.Context, /, group: str, ids: tuple[int, ...], reason: str | None, execute: bool,
                         **opts: Any) -> None:
    """Mark waiting dead letters fixed by hand elsewhere (status resolved), recording who, when and why.

    With --id, those letters at once, all or none. Without it, every waiting letter the filters
    match (all, with none) is counted, and with --execute resolved, a page at a time.
    """
    _close(ctx, deadletters.RESOLVED, group, ids, reason, execute, opts)
