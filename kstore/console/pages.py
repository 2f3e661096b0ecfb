"""The console's pages: each reads through, and acts through, the same library calls as the ``kstore``
commands (:mod:`kstore.ops`, :mod:`kstore.db.deadletters`, :mod:`kstore.db.letterquery`), so the
console and the CLI never disagree. An action's outcome (or its one-line error) is shown on the
page it redirects to.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from kstore.db import deadletters
from kstore.db.deadletters import Edit
from kstore.db.letterquery import (
    discard_matching,
    list_dead_letters,
    resolve_matching,
)
from kstore.db.sqlerrors import first_line
from kstore.errors import ConfigurationError, KstoreError
from kstore.ops import offsets as offsets_admin
from kstore.ops import outbox as outbox_admin
from kstore.ops import replay as replays

from . import params
from .access import console_of, guard
from .sampling import PARTITION_RETENTION, svg_chart, throughput
from .state import Console, Shown, flash

T = TypeVar("T")
#: How far back the overview's charts go.
CHART_SPAN = timedelta(hours=3)
PAGE_SIZE = 50


async def _attempt(console: Console, operator: str | None, fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """``fn()``'s result, or its error as one line (secrets masked): a page shows it instead of failing."""
    try:
        return await console.call(operator, fn), None
    except KstoreError as exc:
        return None, console.mask(str(exc))
    except SQLAlchemyError as exc:  # a read the library does not wrap: the database is down, most likely
        return None, console.mask(f"database {console.settings.safe_dsn}: {first_line(exc)}")


async def groups(request: Request) -> Response:
    operator, _ = await guard(request)
    console = console_of(request)
    found, error = await _attempt(console, operator, console.store.groups)
    return console.render(request, "groups.html", operator, groups=found or [], error=error)


async def overview(request: Request) -> Response:
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    reading, error = await _attempt(console, operator, lambda: console.read(group))
    history = (await _attempt(console, None, lambda: console.sampler.history(group, CHART_SPAN)))[0] or []
    workers: dict[str, list[str]] = defaultdict(list)
    for p in reading.partitions if reading else []:
        if p.owner:
            workers[p.owner].append(f"{p.topic}[{p.partition}]")
    shards = reading.outbox if reading else []
    oldest = min((s.oldest for s in shards if s.oldest is not None), default=None)
    charts = [
        svg_chart("lag (messages)", [(s.at, float(s.lag_messages)) for s in history], "messages"),
        svg_chart("throughput (messages/s)", throughput(history), "messages/s"),
    ]
    return console.render(request, "overview.html", operator, group=group, reading=reading, error=error,
                          workers=dict(workers), outbox_waiting=sum(s.waiting for s in shards),
                          outbox_oldest=oldest, charts=charts)


async def partition(request: Request) -> Response:
    """One partition's lag and throughput over its last samples (kept for PARTITION_RETENTION)."""
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    topic, number = request.path_params["topic"], request.path_params["partition"]
    history, error = await _attempt(console, None, lambda: console.sampler.partition_history(group, topic, number))
    charts = [
        svg_chart("lag (messages)", [(s.at, float(s.lag_messages)) for s in history or []], "messages"),
        svg_chart("throughput (messages/s)", throughput(history or []), "messages/s"),
    ]
    return console.render(request, "partition.html", operator, group=group, topic=topic, partition=number,
                          charts=charts, error=error, minutes=round(PARTITION_RETENTION.total_seconds() / 60))


async def letters(request: Request) -> Response:
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    query = request.query_params
    shown = {name: query.get(name, "") for name in params.FILTERS}
    try:
        where, after = params.letter_filter(query), params.integer("after", params.given(query, "after")) or 0
    except params.BadParameter as exc:
        return console.render(request, "letters.html", operator, status=exc.status, group=group, page=None,
                              error=exc.why, filters=shown, statuses=params.STATUSES, can_replay=False)
    found, error = await _attempt(
        console, operator, lambda: list_dead_letters(console.settings, group, where, PAGE_SIZE, after))
    # The next page's link is built from the route, not this request's path (which the server decoded once).
    next_url = found and request.url_for("letters", group=group).include_query_params(
        **{k: v for k, v in query.items() if k != "after"}, after=found.next_after)
    return console.render(request, "letters.html", operator, group=group, page=found, error=error, next_url=next_url,
                          filters=shown, statuses=params.STATUSES, can_replay=group in console.processors)


async def letter(request: Request) -> Response:
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    letter_id = request.path_params["letter_id"]
    found, error = await _attempt(console, operator,
                                  lambda: deadletters.show_dead_letter(console.settings, letter_id))
    d, changes = found if found else (None, [])
    key, value = (await run_in_threadpool(lambda: (console.shown(d.key), console.shown(d.value)))
                  if d else (Shown(""), Shown("")))
    return console.render(request, "letter.html", operator, group=group, letter=d, changes=changes, error=error,
                          key=key, value=value, can_replay=group in console.processors)


async def act_on_letter(request: Request) -> Response:
    operator, form = await guard(request, action=True)
    assert form is not None
    console, group = console_of(request), request.path_params["group"]
    letter_id, action = request.path_params["letter_id"], request.path_params["action"]
    reason = str(form.get("reason", "")).strip()

    def act() -> str:
        if action == "replay":
            edits = _edit(console, letter_id, form)
            done = replays.replay_dead_letters(console.settings, console.processor(group), group, [letter_id],
                                               edits, reason or None)
            if done.failed:
                raise KstoreError(f"dead letter {letter_id} failed again: {done.failed[letter_id]}")
            if not done.replayed:
                return f"dead letter {letter_id} was not replayed (already replayed, or not of {group!r})"
            return f"replayed dead letter {letter_id}" + (" with the edited value" if edits else "")
        close = {"discard": deadletters.discard_dead_letters, "resolve": deadletters.resolve_dead_letters}.get(action)
        if close is None:
            raise ConfigurationError(f"no action {action!r}")
        changed = close(console.settings, group, [letter_id], reason)
        return f"{changed.status} dead letter {letter_id}" if changed.changed else f"already {changed.status}"

    said, error = await _attempt(console, operator, act)
    flash(request, "error" if error else "done", error or said or "")
    return RedirectResponse(request.url_for("letter", group=group, letter_id=letter_id), status_code=303)


def _edit(console: Console, letter_id: int, form: FormData) -> dict[int, Edit]:
    """The edit the form asks for: the value box, where it differs from the letter's value."""
    if form.get("edit") != "on":
        return {}
    value = str(form.get("value", "")).replace("\r\n", "\n").encode()
    original = deadletters.show_dead_letter(console.settings, letter_id)[0].value
    return {} if value == original else {letter_id: Edit(value=value)}


async def act_on_matching(request: Request) -> Response:
    operator, form = await guard(request, action=True)
    assert form is not None
    console, group, action = console_of(request), request.path_params["group"], request.path_params["action"]
    reason = str(form.get("reason", "")).strip()
    where = params.letter_filter(form, status=deadletters.DEAD)

    def act() -> str:
        if action == "replay":
            done = replays.replay_matching(console.settings, console.processor(group), group, where, reason or None)
        elif action in ("discard", "resolve"):
            walk = discard_matching if action == "discard" else resolve_matching
            done = walk(console.settings, group, where, reason)
        else:
            raise ConfigurationError(f"no action {action!r}")
        failed = f", failed {done.failed}" if action == "replay" else ""
        return f"{action}: done {done.done}{failed}, skipped {done.skipped}, remaining {done.remaining}"

    said, error = await _attempt(console, operator, act)
    flash(request, "error" if error else "done", error or said or "")
    query = {k: str(form.get(k, "")) for k in params.FILTERS if form.get(k)}
    return RedirectResponse(request.url_for("letters", group=group).include_query_params(**query), status_code=303)


async def offsets(request: Request) -> Response:
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    history, error = await _attempt(console, operator,
                                    lambda: offsets_admin.offset_history(console.settings, group, None, 50))
    rows = (await _attempt(console, None, lambda: console.store.rows(group)))[0] or {}
    topics = sorted({topic for topic, _ in rows})
    return console.render(request, "offsets.html", operator, group=group, history=history or [], error=error,
                          topics=topics, form={})


async def plan_reset(request: Request) -> Response:
    operator, form = await guard(request, action=True)
    assert form is not None
    console, group = console_of(request), request.path_params["group"]

    asked = {k: str(form.get(k, "")) for k in params.RESET_FIELDS}
    try:
        topic, partitions, target = params.reset_request(form)
    except params.BadParameter as exc:
        return console.render(request, "plan.html", operator, status=exc.status, group=group, plan=[],
                              error=exc.why, form=asked)
    planned, error = await _attempt(console, operator, lambda: offsets_admin.set_offsets(
        console.settings, group, topic, partitions, **target))
    return console.render(request, "plan.html", operator, group=group, plan=planned or [], error=error, form=asked)


async def execute_reset(request: Request) -> Response:
    operator, form = await guard(request, action=True)
    assert form is not None
    console, group = console_of(request), request.path_params["group"]

    topic, partitions, target = params.reset_request(form)

    def execute() -> str:
        done = offsets_admin.set_offsets(console.settings, group, topic, partitions, **target,
                                         reason=str(form.get("reason", "")), execute=True, via="kstore console")
        moves = ", ".join(f"{p.topic}[{p.partition}] {p.from_offset} -> {p.to_offset}" for p in done)
        return f"reset applied: {moves}; running workers pick it up within a few seconds"

    said, error = await _attempt(console, operator, execute)
    flash(request, "error" if error else "done", error or said or "")
    return RedirectResponse(request.url_for("offsets", group=group), status_code=303)


async def outbox(request: Request) -> Response:
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    shards, error = await _attempt(console, operator, lambda: outbox_admin.show_outbox(console.settings, group))
    return console.render(request, "outbox.html", operator, group=group, shards=shards or [], error=error)
