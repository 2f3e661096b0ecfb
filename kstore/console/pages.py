"""The console's pages: each reads through, and acts through, the same library calls as the ``kstore``
commands (:mod:`kstore.ops`, :mod:`kstore.db.deadletters`, :mod:`kstore.db.letterquery`), so the
console and the CLI never disagree. An action's outcome (or its one-line error) is shown on the
page it redirects to.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import URL, FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from kstore.db import deadletters
from kstore.db.deadletters import Change, DeadLetter, DeadLetters, Edit
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
from .auth import Refused
from .sampling import PARTITION_RETENTION, svg_chart, throughput
from .state import BASE64, SCHEMA_JSON, TEXT, Console, Shown, flash, plain

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


def _shown_on(request: Request, page: URL, said: str | None, error: str | None) -> RedirectResponse:
    """Back to ``page`` after an action, which shows its outcome: its one-line error, or what it did."""
    outcome = flash(request, "error" if error else "done", error or said or "")
    return RedirectResponse(page.include_query_params(**outcome), status_code=303)


async def groups(request: Request) -> Response:
    """The groups with stored offsets, and every outbox with its backlog (an application's too, which no
    group's page would show)."""
    operator, _ = await guard(request)
    console = console_of(request)
    found, error = await _attempt(console, operator, lambda: (
        console.store.groups(), outbox_admin.list_outboxes(console.engine, console.settings)))
    names, outboxes = found or ([], [])
    return console.render(request, "groups.html", operator, groups=names, outboxes=outboxes,
                          now=datetime.now(timezone.utc), error=error)


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


#: The largest record Kafka takes by default (the broker's ``message.max.bytes``): the largest value
#: the edit page offers to edit (a larger one: ``kstore dead-letters replay --value-file``).
KAFKA_RECORD_BYTES = 1_048_588
#: A letter action's largest form field as a browser sends it: a value of that size with each byte
#: sent as six (a line break as ``%0D%0A``); its base64, a third longer with ``+`` and ``/`` sent as
#: three, stays below.
EDIT_FIELD_BYTES = 6 * KAFKA_RECORD_BYTES + 1024
#: How much of a letter's error and traceback its page shows: an error may quote the whole value.
ERROR_PREVIEW_CHARS = 16 * 1024
#: How much of an edited replay's value the letter's history shows.
HISTORY_PREVIEW_CHARS = 256
_CLOSE = {"discard": deadletters.discard_dead_letters, "resolve": deadletters.resolve_dead_letters}


async def letter(request: Request) -> Response:
    """A dead letter's page: its key, value and headers cut to a preview (each downloaded whole), and
    small forms to discard, resolve or replay it as it is; editing its value is a page of its own."""
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    found, error = await _find(request, operator, history=True)
    shown = await run_in_threadpool(lambda: _letter_shown(console, *found)) if found else {"letter": None}
    return console.render(request, "letter.html", operator, group=group, error=error,
                          can_replay=group in console.processors, **shown)


def _letter_shown(console: Console, letter: DeadLetter, changes: list[Change]) -> dict[str, Any]:
    """What the letter page shows of ``letter``: each part cut to its preview."""
    return {
        "letter": letter, "key": console.shown(letter.key), "value": console.shown(letter.value),
        "headers": [(name, plain(value)) for name, value in letter.headers],
        "letter_error": Shown(letter.error, limit=ERROR_PREVIEW_CHARS),
        "first_error": None if letter.first_error is None else Shown(letter.first_error, limit=ERROR_PREVIEW_CHARS),
        "traceback": Shown(letter.traceback, limit=ERROR_PREVIEW_CHARS),
        "history": [(c, plain(c.replayed_value, HISTORY_PREVIEW_CHARS) if c.edited else None) for c in changes],
    }


def _letter_of(console: Console, group: str, letter_id: int,
               history: bool) -> tuple[DeadLetter, list[Change]] | None:
    """The group's dead letter ``letter_id`` and, if asked, its history; None if the group has no
    such letter: a group's pages never show, nor act on, another group's letters."""
    with DeadLetters(console.settings, console.engine) as letters:
        try:
            found = letters.get(letter_id)
        except KstoreError:  # its one refusal, no such letter (the database's failures are SQLAlchemy's)
            return None
        if found.consumer_group != group:
            return None
        return found, letters.history(letter_id) if history else []


async def _find(request: Request, operator: str | None,
                history: bool = False) -> tuple[tuple[DeadLetter, list[Change]] | None, str | None]:
    """The letter the path names (with its history if asked), or the database's error; Refused (404)
    if the path's group has no such letter."""
    console, group = console_of(request), request.path_params["group"]
    letter_id = request.path_params["letter_id"]
    found, error = await _attempt(console, operator, lambda: _letter_of(console, group, letter_id, history))
    if found is None and error is None:
        raise Refused(404, "this group has no dead letter with that id")
    return found, error


async def _needed(request: Request, operator: str | None) -> DeadLetter:
    """The letter the path names, for a download, the edit page or an action; a database that fails
    is refused (503) with its error."""
    found, error = await _find(request, operator)
    if found is None:
        raise Refused(503, error or "the database did not answer")
    return found[0]


async def letter_key(request: Request) -> Response:
    """A dead letter's key, its bytes exactly, as a file."""
    return await _download(request, "key")


async def letter_value(request: Request) -> Response:
    """A dead letter's value, its bytes exactly, as a file."""
    return await _download(request, "value")


async def _download(request: Request, part: str) -> Response:
    operator, _ = await guard(request)
    found = await _needed(request, operator)
    data = found.key if part == "key" else found.value
    if data is None:
        raise Refused(404, f"this dead letter's {part} is null: there is nothing to download")
    # The id alone names the file: nothing of the letter's own (a topic, a group) reaches the header.
    name = f"dead-letter-{found.id}-{part}.bin"
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


async def letter_edit(request: Request) -> Response:
    """The page that replays a dead letter with its value edited: the whole value in the box of a form
    of its own, as text, as base64, or decoded as JSON (see :func:`kstore.console.state.plain`)."""
    operator, _ = await guard(request)
    console = console_of(request)
    if console.read_only:
        raise Refused(403, "this console is read-only: it takes no action")
    found = await _needed(request, operator)
    value = await run_in_threadpool(lambda: console.shown(found.value))
    return _edit_page(request, operator, found, value, value.text)


def _edit_page(request: Request, operator: str | None, found: DeadLetter, value: Shown, box: str,
               error: str | None = None, status: int = 200) -> Response:
    """The edit page with ``box`` in its box (the letter's value, or the operator's edit sent back)."""
    console, group = console_of(request), request.path_params["group"]
    # Within these, the box as a browser sends it fits EDIT_FIELD_BYTES, whatever its characters.
    editable = (value.size or 0) <= KAFKA_RECORD_BYTES and len(value.text) <= 2 * KAFKA_RECORD_BYTES
    return console.render(request, "letter.html", operator, status=status, editing=True, group=group,
                          letter=found, value=value, box=box, error=error, editable=editable,
                          largest=KAFKA_RECORD_BYTES, can_replay=group in console.processors)


async def act_on_letter(request: Request) -> Response:
    """Discard, resolve or replay one dead letter: as it is, or with the value the edit page sends."""
    operator, form = await _action_form(request)
    console, group = console_of(request), request.path_params["group"]
    action = request.path_params["action"]
    found = await _needed(request, operator)
    reason = str(form.get("reason", "")).strip()
    try:
        edits = await console.call(operator, lambda: _edit(console, found, form)) if action == "replay" else {}
    except KstoreError as exc:  # the box is not what its encoding says: the edit page again, the edit kept
        value = await run_in_threadpool(lambda: console.shown(found.value))
        return _edit_page(request, operator, found, value, str(form.get("value", "")), console.mask(str(exc)), 400)
    said, error = await _attempt(console, operator, lambda: _act(console, group, found.id, action, reason, edits))
    return _shown_on(request, request.url_for("letter", group=group, letter_id=found.id), said, error)


async def _action_form(request: Request) -> tuple[str | None, FormData]:
    """:func:`guard`'s checks of an action on a letter, its form read with room for an edited value
    as large as Kafka takes."""
    try:
        operator, form = await guard(request, action=True, max_part_size=EDIT_FIELD_BYTES)
    except HTTPException as exc:  # Starlette's answer to a form over its limits
        raise Refused(413, f"the form is larger than this console takes ({exc.detail}): replay a value over "
                           f"{KAFKA_RECORD_BYTES:,} bytes with kstore dead-letters replay --value-file") from None
    assert form is not None
    return operator, form


def _act(console: Console, group: str, letter_id: int, action: str, reason: str, edits: dict[int, Edit]) -> str:
    """Take ``action`` on the group's letter; what was done, as the page's flash says it."""
    if action == "replay":
        done = replays.replay_dead_letters(console.settings, console.processor(group), group, [letter_id],
                                           edits, reason or None)
        if done.failed:
            raise KstoreError(f"dead letter {letter_id} failed again: {done.failed[letter_id]}")
        if not done.replayed:
            return f"dead letter {letter_id} was not replayed: it was replayed already"
        return f"replayed dead letter {letter_id}" + (" with the edited value" if edits else "")
    close = _CLOSE.get(action)
    if close is None:
        raise ConfigurationError("no such action: discard, resolve or replay")
    changed = close(console.settings, group, [letter_id], reason)
    return f"{changed.status} dead letter {letter_id}" if changed.changed else f"already {changed.status}"


def _edit(console: Console, letter: DeadLetter, form: FormData) -> dict[int, Edit]:
    """The edit the form asks for: the value box read as its ``encoding`` says, where it differs from
    the letter's value (unchanged, the letter replays as it is and no edit is recorded)."""
    if form.get("edit") != "on":
        return {}
    value = _edited_value(console, letter.value, str(form.get("value", "")), str(form.get("encoding", TEXT)))
    return {} if value is None else {letter.id: Edit(value=value)}


def _edited_value(console: Console, original: bytes | None, box: str, encoding: str) -> bytes | None:
    """The box's bytes; None if they are the original's. A textarea sends each line break as CR LF,
    and text shown in one never held a CR (:func:`~kstore.console.state.plain`): each CR LF was a LF."""
    if encoding == SCHEMA_JSON:
        text = box.replace("\r\n", "\n")
        return None if text == console.shown(original).text else text.encode()
    if encoding == BASE64:
        new = _from_base64(box)
    elif encoding == TEXT:
        new = box.replace("\r\n", "\n").encode()
    else:
        raise ConfigurationError("the edit's encoding is text, base64 or json")
    return None if new == (original or b"") else new


def _from_base64(box: str) -> bytes:
    """The box's base64, strictly: line breaks and spaces aside, it must be exactly the base64 of the
    bytes it gives (a character outside its alphabet, a missing or extra ``=`` is an error), so no
    character of the edit is silently dropped."""
    given = "".join(box.split())
    try:
        found = base64.b64decode(given, validate=True)
    except ValueError as exc:  # binascii.Error, or a character that is not ASCII
        raise ConfigurationError(f"the edited value is not base64 ({exc}): nothing was replayed") from None
    if base64.b64encode(found).decode() != given:
        raise ConfigurationError("the edited value is not base64 (it has more than the base64 of its bytes, "
                                 "e.g. an extra '='): nothing was replayed")
    return found


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
    query = {k: str(form.get(k, "")) for k in params.FILTERS if form.get(k)}
    return _shown_on(request, request.url_for("letters", group=group).include_query_params(**query), said, error)


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
    return _shown_on(request, request.url_for("offsets", group=group), said, error)


async def outbox(request: Request) -> Response:
    operator, _ = await guard(request)
    console, group = console_of(request), request.path_params["group"]
    shards, error = await _attempt(console, operator, lambda: outbox_admin.show_outbox(console.settings, group))
    return console.render(request, "outbox.html", operator, group=group, shards=shards or [], error=error)
