"""The operator's commands: ``kstore offsets``, ``outbox``, ``exporter``, ``top``, ``topics``
(and ``kstore dead-letters``, from :mod:`kstore.cli.letters`).

Each parses its options, builds Settings and calls one function of :mod:`kstore.ops`, and prints
what it returned. None of them needs a worker running.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import click

from kstore.cli.common import (
    dsn_option,
    group_connection_options,
    iso_time,
    kafka_connection_options,
    run,
    stop_on_signals,
    table,
)
from kstore.cli.letters import dead_letters
from kstore.ops import offsets as offsets_admin
from kstore.ops import outbox as outbox_admin
from kstore.ops import topics as topics_admin
from kstore.processor import Processor
from kstore.running.loading import load_processor
from kstore.settings import Settings

__all__ = ["dead_letters", "exporter", "offsets", "outbox", "top", "topics"]


@click.group()
def offsets() -> None:
    """See where a pipeline stands and move it (replay, skip, start at the end)."""


@offsets.command("show")
@group_connection_options
@click.option("--topic", default=None, help="Only this topic (default: every topic the group has offsets for).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def offsets_show(ctx: click.Context, /, group: str, topic: str | None, as_json: bool, **opts: Any) -> None:
    """Stored offset, log start and end, lag, epoch, last update and live owner of each partition."""
    rows = run(ctx, lambda: Settings.from_env(**opts), lambda s: offsets_admin.show_offsets(s, group, topic))
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    click.echo(table(["TOPIC", "PARTITION", "NEXT_OFFSET", "LOG_START", "LOG_END", "LAG", "EPOCH", "UPDATED", "OWNER"],
                      [[r.topic, r.partition, r.next_offset, r.log_start, r.log_end, r.lag, r.epoch,
                        r.updated_at.strftime("%Y-%m-%d %H:%M:%S") if r.updated_at else None, r.owner]
                       for r in rows]))


@offsets.command("set")
@group_connection_options
@click.option("--topic", required=True)
@click.option("--partition", "partitions", type=int, multiple=True, help="Repeatable; default: every partition.")
@click.option("--to-offset", type=int, default=None)
@click.option("--to-datetime", default=None, callback=lambda _c, _p, v: None if v is None else iso_time(v),
              help="ISO 8601 with a timezone, e.g. 2026-11-30T08:00:00Z")
@click.option("--to-earliest", is_flag=True)
@click.option("--to-latest", is_flag=True)
@click.option("--shift-by", type=int, default=None, help="Move by N from the stored offset (negative: replay).")
@click.option("--clamp", is_flag=True, help="Move out-of-range targets to the nearest end instead of refusing.")
@click.option("--reason", default=None, help="Why; recorded in the reset history (required with --execute).")
@click.option("--execute", is_flag=True, help="Apply the plan; without it, only print it.")
@click.pass_context
def offsets_set(ctx: click.Context, /, group: str, topic: str, partitions: tuple[int, ...], **opts: Any) -> None:
    """Move a group's partitions on a topic; prints the plan, and applies it with --execute."""
    names = ("to_offset", "to_datetime", "to_earliest", "to_latest", "shift_by", "clamp", "reason", "execute")
    params = {k: opts.pop(k) for k in names}
    plan = run(ctx, lambda: Settings.from_env(**opts),
               lambda s: offsets_admin.set_offsets(s, group, topic, partitions or None, **params))
    click.echo(table(["TOPIC", "PARTITION", "FROM", "TO", "NOTE"],
                      [[p.topic, p.partition, p.from_offset, p.to_offset, p.note] for p in plan]))
    if params["execute"]:
        click.echo(f"applied: running workers of {group!r} pick it up within a few seconds")
        _echo_mirror(group, {p.mirror for p in plan if p.mirror})
    else:
        click.echo("dry run: nothing changed; add --execute to apply")


def _echo_mirror(group: str, outcomes: set[str]) -> None:
    """What became of the group's offsets in Kafka, where it mirrors them (``mirror_offsets``)."""
    for outcome in sorted(outcomes):
        if outcome == "moved":
            click.echo(f"Kafka's committed offsets of {group!r} (mirror_offsets, for lag tools) moved too")
        elif outcome == "left to live workers":
            click.echo(f"Kafka's committed offsets of {group!r} (mirror_offsets) are left to its live workers: "
                       "they mirror the new offsets once they follow the move")
        else:
            click.echo(f"kstore: warning: Kafka's committed offsets of {group!r} (mirror_offsets) were {outcome}; "
                       "lag tools show the old offsets until a worker of the group commits", err=True)


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
    rows = run(ctx, lambda: Settings.from_env(**db), lambda s: offsets_admin.offset_history(s, group, topic, limit))
    if as_json:
        click.echo(json.dumps([{**dataclasses.asdict(r), "at": r.at.isoformat()} for r in rows], indent=2))
        return
    click.echo(table(["AT", "TOPIC", "PARTITION", "FROM", "TO", "EPOCH", "BY", "REQUEST", "REASON"],
                      [[r.at.strftime("%Y-%m-%d %H:%M:%S"), r.topic, r.partition_id, r.from_offset, r.to_offset,
                        r.epoch, f"{r.by_user}@{r.by_host}", r.request_id, r.reason] for r in rows]))


@click.group()
def outbox() -> None:
    """What a group's processor produced and its relays have not yet published to Kafka."""


@outbox.command("show")
@dsn_option
@click.option("--group", required=True, help="Pipeline name (Kafka group id).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def outbox_show(ctx: click.Context, /, group: str, as_json: bool, **db: Any) -> None:
    """Rows waiting, the oldest's age, next and published seq, relay and lease left of each outbox shard."""
    rows = run(ctx, lambda: Settings.from_env(**db), lambda s: outbox_admin.show_outbox(s, group))
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    click.echo(table(["SHARD", "WAITING", "OLDEST", "NEXT_SEQ", "PUBLISHED_SEQ", "OWNER", "LEASE_LEFT"],
                      [[r.shard, r.waiting, None if r.oldest_age_s is None else f"{r.oldest_age_s:.1f}s",
                        r.next_seq, r.published_seq, r.owner, _lease(r)] for r in rows]))
    for r in rows:
        if r.refusal is not None:
            click.echo(f"shard {r.shard}: last row Kafka refused: {r.refusal}")


@outbox.command("reshard")
@click.argument("name")
@dsn_option
@click.option("--shards", type=click.IntRange(min=1), required=True, help="The number of shards it gets.")
@click.pass_context
def outbox_reshard(ctx: click.Context, /, name: str, shards: int, **db: Any) -> None:
    """Give outbox NAME (an application's, or a group's) another number of shards, in one transaction.

    Refused while records wait in it or any of its relays runs: stop the application's writes, let
    the relays publish what waits, stop them, then reshard, and start the application (with the new
    count) and the relays again.
    """
    done = run(ctx, lambda: Settings.from_env(**db), lambda s: outbox_admin.reshard_outbox(s, name, shards))
    if done.before == done.after:
        click.echo(f"outbox {name!r} has {done.after} shard(s) already: nothing changed")
        return
    click.echo(f"outbox {name!r}: {done.before} shard(s) -> {done.after}; start the application with "
               f"Outbox({name!r}, shards={done.after}), then its relays")


def _lease(r: outbox_admin.ShardStatus) -> str | None:
    if r.owner is None:
        return None
    return f"{r.lease_left_s:.1f}s" if r.lease_left_s > 0 else "expired"


@click.command()
@dsn_option
@kafka_connection_options
@click.option("--group", "groups", multiple=True, required=True, help="A pipeline (Kafka group id); repeatable.")
@click.option("--port", type=int, required=True, help="Serve /metrics on this port (0: any free port, logged).")
@click.option("--address", default="0.0.0.0", show_default=True, help="Listen on this address.")
@click.pass_context
def exporter(ctx: click.Context, /, groups: tuple[str, ...], port: int, address: str, **opts: Any) -> None:
    """Serve the lag of groups as Prometheus metrics on /metrics, no worker needed, until SIGTERM/SIGINT."""
    from kstore.ops.exporter import Exporter  # when the command runs, as before: the other commands never import it

    def serve(settings: Settings) -> None:
        server = Exporter(settings, groups, port, address)
        stop_on_signals(server.request_stop)
        server.run()

    run(ctx, lambda: Settings.from_env(**opts), serve)


@click.command()
@group_connection_options
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit (an unreadable group: one line, exit 2).")
@click.pass_context
def top(ctx: click.Context, /, group: str, interval: float, once: bool, **opts: Any) -> None:
    """A live view of a group's partitions: offsets, lag, owner, epoch, throughput, dead letters."""
    from kstore.ops.top import Top  # when the command runs: the other commands never load rich

    def watch(settings: Settings) -> None:
        view = Top(settings, group, interval)
        if once:
            view.print_once()
            return
        stop_on_signals(view.request_stop)
        view.run()

    run(ctx, lambda: Settings.from_env(**opts), watch)


@click.group()
def topics() -> None:
    """The topics a processor consumes and produces to, or topics named one by one: which exist, and
    creating the missing ones."""


def _topics_settings(topic: tuple[str, ...], opts: dict[str, Any]) -> Settings:
    return Settings.from_env(topics=tuple(topic) or None, **opts)


def _load(processor: str) -> Processor:
    sys.path.insert(0, os.getcwd())
    return load_processor(processor)


@topics.command("list")
@click.argument("targets", nargs=-1, required=True, metavar="PROCESSOR | TOPIC...")
@kafka_connection_options
@click.option("--topic", "topic", multiple=True, help="Input topic (repeatable); overrides the processor's.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def topics_list(ctx: click.Context, /, targets: tuple[str, ...], topic: tuple[str, ...], as_json: bool,
                **opts: Any) -> None:
    """PROCESSOR's (MODULE:CLASS) input topics and declared output topics (``produces``), or the TOPICs
    named (no ':' in a topic's name), and which exist."""
    rows = run(ctx, lambda: _topics_settings(topic, opts),
               lambda s: topics_admin.list_or_create(s, targets, _load, inputs_replaced=bool(topic)))
    _print_topics(rows, as_json)


@topics.command("create")
@click.argument("targets", nargs=-1, required=True, metavar="PROCESSOR | TOPIC...")
@kafka_connection_options
@click.option("--topic", "topic", multiple=True, help="Input topic (repeatable); overrides the processor's.")
@click.option("--partitions", type=int, default=None, help="Partitions of each topic created [default: the brokers'].")
@click.option("--replication-factor", type=int, default=None,
              help="Replicas of each topic created [default: the brokers'].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def topics_create(ctx: click.Context, /, targets: tuple[str, ...], topic: tuple[str, ...], partitions: int | None,
                  replication_factor: int | None, as_json: bool, **opts: Any) -> None:
    """Create PROCESSOR's (MODULE:CLASS) input and declared output topics that do not exist yet (the others
    are left as they are), or the TOPICs named (an application outbox's, say; no ':' in a topic's name),
    of which one that exists with other partitions than --partitions is an error."""
    rows = run(ctx, lambda: _topics_settings(topic, opts),
               lambda s: topics_admin.list_or_create(s, targets, _load, create=True, partitions=partitions,
                                                     replication_factor=replication_factor,
                                                     inputs_replaced=bool(topic)))
    _print_topics(rows, as_json)


def _print_topics(rows: list[topics_admin.TopicState], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([{**dataclasses.asdict(r), "exists": r.exists} for r in rows], indent=2))
        return
    click.echo(table(["TOPIC", "ROLE", "PARTITIONS", "STATE"],
                     [[r.topic, r.role, r.partitions or None,
                       "created" if r.created else "exists" if r.exists else "missing"] for r in rows]))
