"""Which dead letters: a filter shared by ``list``, ``replay``, ``discard`` and ``resolve``, its counts,
and pages of the letters it matches, in id order.

Pages are keyset pages: each starts after the last id of the one before (``id > after ORDER BY id
LIMIT n``), never at an OFFSET, so a page costs the same at the millionth letter as at the first,
and a letter that changes (or stays as it was) between two pages neither shifts nor repeats the
pages after it. Counts are ``COUNT(*)`` in the database: no id is held in memory to count it.
The group's letters are read through the index on ``(consumer_group, status, id)`` (migration 0003).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, func, or_, select

from kstore.errors import ConfigurationError, KstoreError
from kstore.settings import Settings

from .deadletters import (
    ACTIONS,
    DEAD,
    DISCARDED,
    RESOLVED,
    STATUSES,
    DeadLetter,
    DeadLetterBusyError,
    DeadLetters,
    _row,
)


@dataclass(frozen=True)
class LetterFilter:
    """Which of a group's dead letters: each field given narrows the match; the default is every waiting one.

    ``status`` None matches every status. ``error_type`` is the exception's class name (the error
    reads ``ValueError: ...``); ``error`` is text the error contains, in any case. ``since`` and
    ``until`` bound the letter's last failure: at or after ``since``, before ``until``.
    """

    status: str | None = DEAD
    topic: str | None = None
    partition: int | None = None
    error_type: str | None = None
    error: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUSES:
            raise ConfigurationError(f"unknown dead-letter status {self.status!r}: one of {', '.join(STATUSES)}")
        if self.partition is not None and self.partition < 0:
            raise ConfigurationError(f"a partition is 0 or more, not {self.partition}")
        for name in ("since", "until"):
            when = getattr(self, name)
            if when is not None and when.tzinfo is None:
                raise ConfigurationError(f"give {name} a timezone, e.g. {when.isoformat()}+00:00")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ConfigurationError(f"since ({self.since.isoformat()}) must be before until "
                                     f"({self.until.isoformat()})")

    def narrows(self) -> bool:
        """Whether anything but the status is asked for."""
        return any(v is not None for v in (self.topic, self.partition, self.error_type, self.error, self.since,
                                           self.until))

    def clauses(self, t: Table, group: str) -> list[ColumnElement[bool]]:
        """The WHERE clauses of this filter on the dead-letter table ``t``, for ``group``."""
        where = [t.c.consumer_group == group]
        if self.status is not None:
            where.append(t.c.status == self.status)
        if self.topic is not None:
            where.append(t.c.topic == self.topic)
        if self.partition is not None:
            where.append(t.c.partition_id == self.partition)
        # A letter is found by its error now and by the one it was dead-lettered with (a failed replay's
        # error takes the first's place; see first_error).
        errors = (t.c.error, t.c.first_error)
        if self.error_type is not None:
            # The error is "<class name>: <message>" (or the bare name for an empty message).
            where.append(or_(*(e.startswith(f"{self.error_type}:", autoescape=True) | (e == self.error_type)
                               for e in errors)))
        if self.error is not None:
            where.append(or_(*(e.icontains(self.error, autoescape=True) for e in errors)))
        if self.since is not None:
            where.append(t.c.last_failure_at >= self.since)
        if self.until is not None:
            where.append(t.c.last_failure_at < self.until)
        return where


@dataclass(frozen=True)
class Span:
    """How many letters a filter matches, and the lowest and highest of their ids (None if none)."""

    count: int
    first_id: int | None
    last_id: int | None


def span(conn: Connection, t: Table, group: str, where: LetterFilter, after: int = 0) -> Span:
    """``COUNT(*)``, ``MIN(id)``, ``MAX(id)`` of the letters ``where`` matches with an id above ``after``."""
    row = conn.execute(select(func.count(), func.min(t.c.id), func.max(t.c.id))
                       .where(*where.clauses(t, group), t.c.id > after)).one()
    return Span(int(row[0]), row[1], row[2])


def page(conn: Connection, t: Table, group: str, where: LetterFilter, after: int, limit: int,
         upto: int | None = None, columns: Any = None) -> list[Any]:
    """The next ``limit`` rows ``where`` matches with an id above ``after`` (and at most ``upto``), by id."""
    stmt = select(*(columns if columns is not None else [t])).where(*where.clauses(t, group), t.c.id > after)
    if upto is not None:
        stmt = stmt.where(t.c.id <= upto)
    return list(conn.execute(stmt.order_by(t.c.id).limit(limit)))


def _pages(letters: DeadLetters, group: str, where: LetterFilter, upto: int, size: int,
           columns: Any = None) -> Iterator[list[Any]]:
    """Every row ``where`` matches with an id up to ``upto``, ``size`` at a time, each page read on its
    own short connection (nothing stays open while the caller acts on a page).

    The next page starts after the last id of the one before, whatever the caller did to it:
    a letter that stays as it was (a replay that failed again) is never read twice.
    """
    after = 0
    while True:
        with letters.engine.connect() as conn:
            rows = page(conn, letters.table, group, where, after, size, upto, columns)
        if not rows:
            return
        yield rows
        after = rows[-1].id


def walk(letters: DeadLetters, group: str, where: LetterFilter, upto: int, size: int) -> Iterator[list[DeadLetter]]:
    """The letters ``where`` matches with an id up to ``upto``, a page of ``size`` at a time; see :func:`_pages`."""
    for rows in _pages(letters, group, where, upto, size):
        yield [_row(r) for r in rows]


@dataclass(frozen=True)
class LetterPage:
    """One page of a listing: its letters, how many the filter matches in all, and how many come after it."""

    letters: list[DeadLetter]
    total: int
    more: int

    @property
    def next_after(self) -> int | None:
        """The ``after`` of the next page (None when this is the last)."""
        return self.letters[-1].id if self.more and self.letters else None


#: The most a listing shows at once (``--limit``); past it, page with ``--after``.
MAX_PAGE = 10_000


def list_dead_letters(settings: Settings, group: str, where: LetterFilter | None = None, limit: int = 100,
                      after: int = 0) -> LetterPage:
    """A page of a group's dead letters (default: the waiting ones), by id, from after ``after``, with
    how many match in all and how many come after the page."""
    if not 1 <= limit <= MAX_PAGE:
        raise ConfigurationError(f"a page holds 1 to {MAX_PAGE} letters, not {limit} (--limit)")
    where = where or LetterFilter()
    with DeadLetters(settings) as letters:
        t = letters.table
        with letters.engine.connect() as conn:
            found = [_row(r) for r in page(conn, t, group, where, after, limit)]
            total = span(conn, t, group, where).count
            more = span(conn, t, group, where, found[-1].id).count if found else 0
        if not total:
            letters.check_known(group)  # a typo'd group is not "no dead letters"
        return LetterPage(found, total, more)


#: How many letters a walk reads (and a discard or resolve changes in one transaction) at a time.
BATCH = 100
#: How many failures (id and error) a walk keeps to report; past it, only the count grows.
FAILURES_KEPT = 100


@dataclass
class Tally:
    """What a walk over the letters a filter matched did: how many it ``done`` (replayed, discarded or
    resolved), ``failed`` (a replay that failed again: the letter stays dead) and ``skipped`` (another
    operator had it, or got there first), and how many matching letters it did not reach
    (``remaining``: dead-lettered after it started). ``first_id``..``last_id`` is the span it walked.
    """

    action: str
    done: int = 0
    failed: int = 0
    skipped: int = 0
    remaining: int = 0
    first_id: int | None = None
    last_id: int | None = None
    #: The first :data:`FAILURES_KEPT` failures: letter id -> error.
    failures: dict[int, str] = field(default_factory=dict)

    def fail(self, letter_id: int, error: str) -> None:
        self.failed += 1
        if len(self.failures) < FAILURES_KEPT:
            self.failures[letter_id] = error

    def so_far(self, exc: KstoreError) -> KstoreError:
        """``exc`` (of the same class) saying what this walk had done before it, to raise instead."""
        past = {"replay": "replayed", "discard": "discarded", "resolve": "resolved"}[self.action]
        return type(exc)(f"{exc}; before it this command {past} {self.done}, failed {self.failed}, skipped "
                         f"{self.skipped} (those stay as they are: running it again goes on with the rest)")


def waiting(where: LetterFilter | None) -> LetterFilter:
    """The filter of an action: only waiting (dead) letters can be replayed, discarded or resolved."""
    where = where or LetterFilter()
    if where.status not in (None, DEAD):
        raise ConfigurationError(f"only waiting (dead) letters can be acted on, not {where.status} ones")
    return replace(where, status=DEAD)


def plan_dead_letters(settings: Settings, group: str, where: LetterFilter | None = None) -> Span:
    """How many waiting letters of a group ``where`` matches, and their lowest and highest ids: what
    ``replay``, ``discard`` or ``resolve`` with that filter would act on (their dry run)."""
    with DeadLetters(settings) as letters:
        return start(letters, group, waiting(where))


def start(letters: DeadLetters, group: str, where: LetterFilter) -> Span:
    """The span a walk covers: the matching letters there at its start (one typo'd group is an error)."""
    with letters.engine.connect() as conn:
        found = span(conn, letters.table, group, where)
    if not found.count:
        letters.check_known(group)
    return found


def finish(letters: DeadLetters, group: str, where: LetterFilter, tally: Tally) -> Tally:
    """Count what the walk left: matching letters past its span (dead-lettered after it started)."""
    with letters.engine.connect() as conn:
        tally.remaining = span(conn, letters.table, group, where, tally.last_id or 0).count
    return tally


def discard_matching(settings: Settings, group: str, where: LetterFilter | None, reason: str,
                     size: int = BATCH) -> Tally:
    """Discard every waiting letter of a group that ``where`` matches (default: all), ``size`` letters a
    transaction, recording who, when and why; see :func:`close_matching`."""
    return close_matching(settings, group, DISCARDED, where, reason, size)


def resolve_matching(settings: Settings, group: str, where: LetterFilter | None, reason: str,
                     size: int = BATCH) -> Tally:
    """Resolve every waiting letter of a group that ``where`` matches (default: all), ``size`` letters a
    transaction, recording who, when and why; see :func:`close_matching`."""
    return close_matching(settings, group, RESOLVED, where, reason, size)


def close_matching(settings: Settings, group: str, status: str, where: LetterFilter | None, reason: str,
                   size: int = BATCH) -> Tally:
    """Move every waiting letter ``where`` matches, up to the highest id there at the start, to ``status``.

    Page by page (keyset, by id), each page in one transaction of its own, as a discard or resolve
    by id is (a history row per letter, a request id per page, a lost COMMIT read back). A letter
    another operator is changing (its lock held) or changed since the page was read is skipped.
    An error stops the walk; what landed before it stays, and its message says how much that was.
    """
    where = waiting(where)
    if not reason.strip():
        raise ConfigurationError(f"give a reason for the {ACTIONS[status]} (--reason)")
    tally = Tally(ACTIONS[status])
    with DeadLetters(settings) as letters:
        found = start(letters, group, where)
        if found.last_id is None:
            return tally
        tally.first_id = found.first_id
        try:
            for rows in _pages(letters, group, where, found.last_id, size, [letters.table.c.id]):
                _close_page(letters, [r.id for r in rows], status, reason, group, tally)
        except KstoreError as exc:
            raise tally.so_far(exc) from None
        tally.last_id = found.last_id
        return finish(letters, group, where, tally)


def _close_page(letters: DeadLetters, ids: Sequence[int], status: str, reason: str, group: str,
                tally: Tally) -> None:
    try:
        changed = len(letters.close_waiting(ids, status, reason, group).changed)
    except DeadLetterBusyError:
        # One of them is being replayed: the others one by one, so that one does not hold them up.
        changed = 0
        for i in ids:
            with suppress(DeadLetterBusyError):
                changed += len(letters.close_waiting([i], status, reason, group).changed)
    tally.done += changed
    tally.skipped += len(ids) - changed
    tally.last_id = ids[-1]
