"""`kstore dead-letters` as docs/failures.md promises it: two operators replaying one letter at once
land its effect once; resolving a resolved letter changes nothing (exit 0); `resolve` takes all its
ids or none."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from kstore.db.deadletters import build_table

from .harness import TESTS_DIR


def kstore_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kstore", *args], cwd=TESTS_DIR, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(TESTS_DIR), **(env or {})})


def kstore(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    p = kstore_cmd(*args, env=env)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def add_letter(dsn: str, value: str, offset: int, group: str = "g") -> int:
    engine = sa.create_engine(dsn)
    stamp = datetime.now(timezone.utc)
    try:
        with engine.begin() as conn:
            return int(conn.execute(build_table().insert().values(
                consumer_group=group, topic="t", partition_id=0, offset=offset, key=b"k", value=value.encode(),
                headers="[]", timestamp=None, error="ValueError: boom", traceback="Traceback ...", attempts=1,
                first_failure_at=stamp, last_failure_at=stamp, status="dead",
            ).returning(build_table().c.id)).scalar_one())
    finally:
        engine.dispose()


def query(dsn: str, sql: str) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql)).all())
    finally:
        engine.dispose()


def statuses(dsn: str) -> dict[int, str]:
    return {r[0]: r[1] for r in query(dsn, "SELECT id, status FROM kstore_dead_letters")}


def history(dsn: str) -> list[tuple[int, str]]:
    rows = query(dsn, "SELECT dead_letter_id, action FROM kstore_dead_letter_history ORDER BY id")
    return [(r[0], r[1]) for r in rows]


def one_error_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kstore: error: "), (code, err)
    assert all(n in lines[0] for n in needles), lines[0]
    assert "Traceback" not in err


def test_two_operators_replaying_one_letter_at_once_land_its_effect_once(pg_dsn: str) -> None:
    letter = add_letter(pg_dsn, "again", offset=5)
    # The replay's batch sleeps 5 s after writing, before it locks the letter and commits: both runs
    # are seen in their transactions at the same moment (pg_stat_activity), so they really overlap.
    args = ("dead-letters", "replay", "processors:Recorder", "--group", "g", "--id", str(letter), "--dsn", pg_dsn)
    runs = [kstore_cmd(*args, env={"KSTORE_TEST_BATCH_SLEEP": "5"}) for _ in range(2)]
    overlapped = False
    while not overlapped and any(p.poll() is None for p in runs):
        overlapped = query(pg_dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND state = 'idle in transaction'")[0][0] >= 2
        time.sleep(0.05)
    results = [(p.wait(120), *p.communicate()) for p in runs]
    assert overlapped, "the two replays never overlapped: never both in a transaction at once"
    assert [code for code, _out, _err in results] == [0, 0], results
    assert query(pg_dsn, "SELECT kafka_offset, value FROM effects") == [(5, "again")]
    assert statuses(pg_dsn) == {letter: "replayed"}
    assert history(pg_dsn) == [(letter, "replay")]
    outputs = sorted(out.strip() for _code, out, _err in results)
    assert any(o.startswith("replayed 1,") for o in outputs) and any("skipped" in o or "already" in o
                                                                      for o in outputs), outputs


def test_resolving_a_resolved_letter_changes_nothing(pg_dsn: str) -> None:
    letter = add_letter(pg_dsn, "a", offset=1)
    base = ("dead-letters", "resolve", "--group", "g", "--id", str(letter), "--dsn", pg_dsn)
    first = kstore(*base, "--reason", "refunded by hand")
    again = kstore(*base, "--reason", "refunded again")
    assert first[0] == 0 and f"resolved 1: {letter}" in first[1], first
    assert again[0] == 0 and again[1].strip() == f"already resolved, left as they were: {letter}", again
    assert statuses(pg_dsn) == {letter: "resolved"}
    assert query(pg_dsn, "SELECT reason FROM kstore_dead_letter_history") == [("refunded by hand",)]


def test_resolve_is_all_or_nothing(pg_dsn: str) -> None:
    dead, dropped, other = add_letter(pg_dsn, "a", 1), add_letter(pg_dsn, "b", 2), add_letter(pg_dsn, "c", 3, "h")
    code, _out, err = kstore("dead-letters", "discard", "--group", "g", "--id", str(dropped), "--reason", "spam",
                             "--dsn", pg_dsn)
    assert code == 0, err
    for ids, needle in [([dead, dropped], f"cannot resolve dead letter {dropped}: it was discarded"),
                        ([dead, 999], "no dead letter with id 999: nothing changed"),
                        ([dead, other], f"dead letter(s) {other} are not of group 'g': nothing changed")]:
        one_error_line(*kstore("dead-letters", "resolve", "--group", "g", *[f"--id={i}" for i in ids],
                               "--reason", "x", "--dsn", pg_dsn)[::2], needle)
    assert statuses(pg_dsn) == {dead: "dead", dropped: "discarded", other: "dead"}
    assert history(pg_dsn) == [(dropped, "discard")]
