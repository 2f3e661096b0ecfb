"""Which dead letters a query names (kstore.db.letterquery), on SQLite through the library: filters
by time, status and error text, a discard by filter, pages, and a filter that cannot match anything,
refused when it is made. Over many letters through ``kstore dead-letters`` on PostgreSQL:
tests/integration/failures_and_dead_letters/test_dead_letters_at_scale.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Message, Settings
from kstore.db import deadletters as dl
from kstore.db.letterquery import LetterFilter, discard_matching, list_dead_letters, plan_dead_letters
from kstore.errors import ConfigurationError
from kstore.retry import Failure


@pytest.mark.parametrize("bad, says", [
    ({"status": "gone"}, "unknown dead-letter status 'gone'"),
    ({"partition": -1}, "a partition is 0 or more"),
    ({"since": datetime(2026, 12, 1)}, "give since a timezone"),
    ({"since": datetime(2026, 12, 2, tzinfo=timezone.utc), "until": datetime(2026, 12, 1, tzinfo=timezone.utc)},
     "must be before until"),
])
def test_a_filter_that_cannot_match_is_refused(bad: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        LetterFilter(**bad)


def dead_letter(dsn: str, n: int, value: Callable[[int], str] = lambda i: f"ok-{i}",
                topic: Callable[[int], str] = lambda i: "orders", error: Callable[[int], Exception] = lambda i:
                ValueError(f"bad quantity in order {i}"), when: datetime | None = None) -> list[int]:
    """``n`` dead letters of group ``g``, offsets 0..n-1 in one transaction, through the worker's write: their ids."""
    table = dl.build_table()
    engine = sa.create_engine(dsn)
    try:
        with engine.begin() as conn:
            for i in range(n):
                failure = Failure()
                failure.record(error(i))
                if when is not None:
                    failure.first_at = failure.last_at = when
                dl.write(conn, table, "g", Message(topic(i), i % 3, i, b"k", value(i).encode()), failure)
            return list(conn.execute(sa.select(table.c.id).order_by(table.c.id)).scalars())[-n:]
    finally:
        engine.dispose()


def test_filters_by_time_and_status_through_the_library_on_sqlite(sqlite_dsn: str) -> None:
    noon = datetime(2026, 12, 1, 12, tzinfo=timezone.utc)
    early = dead_letter(sqlite_dsn, 5, when=noon - timedelta(hours=2), error=lambda i: ValueError("100% off_sale"))
    late = dead_letter(sqlite_dsn, 5, when=noon + timedelta(hours=2), topic=lambda i: "refunds")
    settings = Settings(dsn=sqlite_dsn)

    since_noon = list_dead_letters(settings, "g", LetterFilter(since=noon))
    assert ([d.id for d in since_noon.letters], since_noon.total, since_noon.more) == (late, 5, 0)
    before = plan_dead_letters(settings, "g", LetterFilter(until=noon))
    assert (before.count, before.first_id, before.last_id) == (5, early[0], early[-1])
    # % and _ in the text are matched as themselves, not as LIKE's wildcards.
    assert plan_dead_letters(settings, "g", LetterFilter(error="100% OFF_")).count == 5
    assert plan_dead_letters(settings, "g", LetterFilter(error="100%% off")).count == 0

    done = discard_matching(settings, "g", LetterFilter(until=noon), "test traffic", size=2)
    assert (done.done, done.skipped, done.remaining) == (5, 0, 0)
    page = list_dead_letters(settings, "g", LetterFilter(status=None), limit=4, after=early[2])
    assert ([d.status for d in page.letters], page.total, page.more, page.next_after) == (
        ["discarded", "discarded", "dead", "dead"], 10, 3, late[1])
    assert list_dead_letters(settings, "g", LetterFilter(status="discarded")).total == 5
