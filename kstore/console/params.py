"""What a page's query or form asks for, read before anything runs: a bad value is a 400 that names
the field and what it takes, never a 500, and never repeats what was sent (a page's text is no
place to reflect a visitor's input)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from kstore.db import deadletters
from kstore.db.letterquery import LetterFilter

from .auth import Refused

#: The largest values the database's columns hold: a letter id or an offset (64-bit), a partition (32-bit).
INT64_MAX, INT32_MAX = 2**63 - 1, 2**31 - 1
#: The dead letters' filter fields, as the list's query and the bulk actions' forms carry them.
FILTERS = ("status", "topic", "partition", "error_type", "error", "since", "until")
STATUSES = ("any", *deadletters.STATUSES)
#: The reset form's fields.
RESET_FIELDS = ("topic", "partitions", "target", "value", "clamp")


class BadParameter(Refused):
    """A field of the request that cannot be read: 400, with the field's name and what it takes."""

    def __init__(self, name: str, takes: str) -> None:
        super().__init__(400, f"{name}: give {takes}")


def given(params: Mapping[str, Any], name: str) -> str | None:
    value = str(params.get(name, "") or "").strip()
    return value or None


def integer(name: str, raw: str | None, *, low: int = 0, high: int = INT64_MAX) -> int | None:
    """``raw`` as a whole number from ``low`` to ``high``; None when not given."""
    return None if raw is None else number(name, raw, low=low, high=high)


def number(name: str, raw: str | None, *, low: int = 0, high: int = INT64_MAX) -> int:
    """``raw`` as a whole number from ``low`` to ``high``, which must be given."""
    try:
        value = int(raw or "")
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise BadParameter(name, f"a whole number from {low:,} to {high:,}")
    return value


def when(name: str, raw: str | None) -> datetime | None:
    """``raw`` as an ISO 8601 time with its timezone; None when not given."""
    if raw is None:
        return None
    try:
        found = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        found = None
    if found is None or found.tzinfo is None:
        raise BadParameter(name, "an ISO 8601 time with its timezone, e.g. 2026-01-31T08:00:00Z")
    return found


def letter_filter(params: Mapping[str, Any], status: str | None = None) -> LetterFilter:
    """The dead letters a list's query (or a bulk action's form) asks for; ``status`` overrides its own."""
    asked = status or given(params, "status") or deadletters.DEAD
    if asked not in STATUSES:
        raise BadParameter("status", f"one of {', '.join(STATUSES)}")
    return LetterFilter(
        status=None if asked == "any" else asked, topic=given(params, "topic"),
        partition=integer("partition", given(params, "partition"), high=INT32_MAX),
        error_type=given(params, "error_type"), error=given(params, "error"),
        since=when("since", given(params, "since")), until=when("until", given(params, "until")))


def reset_request(form: Mapping[str, Any]) -> tuple[str, list[int] | None, dict[str, Any]]:
    """The topic, partitions (None: all) and the target keyword of ``set_offsets`` the form asks for."""
    topic = given(form, "topic")
    if topic is None:
        raise BadParameter("topic", "the topic to reset")
    raw = str(form.get("partitions", "")).replace(" ", "")
    partitions = [number("partitions", p, high=INT32_MAX) for p in raw.split(",") if p] or None
    value = given(form, "value")

    def time() -> datetime:
        found = when("time", value)
        if found is None:
            raise BadParameter("time", "an ISO 8601 time with its timezone")
        return found

    kinds: dict[str, Callable[[], dict[str, Any]]] = {
        "offset": lambda: {"to_offset": number("offset", value)},
        "datetime": lambda: {"to_datetime": time()},
        "earliest": lambda: {"to_earliest": True},
        "latest": lambda: {"to_latest": True},
        "shift": lambda: {"shift_by": number("shift", value, low=-INT64_MAX)},
    }
    target = str(form.get("target", ""))
    if target not in kinds:
        raise BadParameter("target", "offset, datetime, earliest, latest or shift")
    return topic, partitions, {**kinds[target](), "clamp": form.get("clamp") == "on"}
