"""The dead-letter table and its changes (kstore.db.deadletters) on SQLite, through the library:
resolve and discard, their history, and a change a letter's status refuses.
The lifecycle through ``kstore dead-letters`` on PostgreSQL:
tests/integration/failures_and_dead_letters/test_dead_letter_lifecycle.py."""

from __future__ import annotations

import getpass
import socket
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.deadletters import (
    DeadLetters,
    DeadLetterStateError,
    build_table,
)
from kstore.db.letterquery import LetterFilter, list_dead_letters

ME = f"{getpass.getuser()}@{socket.gethostname()}"


def add_letter(dsn: str, value: str, group: str = "g", offset: int = 7) -> int:
    engine = sa.create_engine(dsn)
    stamp = datetime.now(timezone.utc)
    with engine.begin() as conn:
        letter_id = conn.execute(build_table().insert().values(
            consumer_group=group, topic="t", partition_id=0, offset=offset, key=b"k", value=value.encode(),
            headers="[]", timestamp=None, error="ValueError: boom", traceback="Traceback ...", attempts=3,
            first_failure_at=stamp, last_failure_at=stamp, status="dead",
        ).returning(build_table().c.id)).scalar_one()
    engine.dispose()
    return int(letter_id)


def test_resolve_and_discard_on_sqlite_through_the_api(sqlite_dsn: str) -> None:
    a, b = add_letter(sqlite_dsn, "a"), add_letter(sqlite_dsn, "b", offset=8)
    letters = DeadLetters(Settings(dsn=sqlite_dsn))
    try:
        done = letters.resolve([a], "patched by hand", group="g")
        assert (done.status, done.changed, done.already) == ("resolved", [a], [])
        assert letters.discard([b], "test data").changed == [b]
        (change,) = letters.history(a)
        assert (change.to_status, change.reason, change.by, change.request_id) == (
            "resolved", "patched by hand", ME, done.request_id)
        with pytest.raises(DeadLetterStateError, match=f"cannot discard dead letter {a}: it was resolved by {ME}"):
            letters.discard([a], "oops")
    finally:
        letters.close()
    assert list_dead_letters(Settings(dsn=sqlite_dsn), "g").letters == []
    every = list_dead_letters(Settings(dsn=sqlite_dsn), "g", LetterFilter(status=None)).letters
    assert [d.status for d in every] == ["resolved", "discarded"]
