"""`kstore dead-letters` as docs/failures.md promises it: a replay of a letter that another operator
is replaying is refused (one line, exit 2), and its effect lands once; resolving a resolved letter
changes nothing (exit 0); `resolve` takes all its ids or none; a group that has neither dead letters
nor stored offsets (a typo) is one line, exit 2, for `list` and `replay`."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kstore import Settings
from kstore.db.deadletters import build_table
from kstore.ops.offsets import set_offsets
from tests.support.harness import SUPPORT_DIR, wait_until


def kstore_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kstore", *args], cwd=SUPPORT_DIR, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR), **(env or {})})


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


def test_a_second_operator_replaying_a_letter_being_replayed_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    letter = add_letter(pg_dsn, "again", offset=5)
    # The first replay's batch waits while the pause file exists (tests/support/processors.py's Recorder), inside
    # the replay's transaction, which holds the letter's lock from its start.
    pause = tmp_path / "pause"
    pause.touch()
    args = ("dead-letters", "replay", "processors:Recorder", "--group", "g", "--id", str(letter), "--dsn", pg_dsn)
    first = kstore_cmd(*args, env={"KSTORE_TEST_PAUSE_FILE": str(pause),
                                   "KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": "120000"})
    try:
        wait_until(lambda: Path(f"{pause}.batch").exists() or first.poll() is not None, 60,
                   what="the first replay inside its batch")
        assert first.poll() is None, first.communicate()
        second = kstore(*args)
        one_error_line(*second[::2], f"dead letter(s) {letter}: another operator is replaying or changing it right "
                       "now", "nothing was done")
        for other in ("discard", "resolve"):  # nor can anyone else act on it meanwhile
            one_error_line(*kstore("dead-letters", other, "--group", "g", "--id", str(letter), "--reason", "x",
                                   "--dsn", pg_dsn)[::2], "another operator is replaying or changing it right now")
        assert first.poll() is None, "the others were refused while the first still ran"
    finally:
        pause.unlink()
    code, out, err = first.wait(120), *first.communicate()
    assert code == 0 and out.startswith("replayed 1,"), (code, out, err)
    assert query(pg_dsn, "SELECT kafka_offset, value FROM effects") == [(5, "again")]
    assert statuses(pg_dsn) == {letter: "replayed"}
    assert history(pg_dsn) == [(letter, "replay")]


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


def test_a_typod_group_is_one_line_for_list_and_replay(pg_dsn: str, kafka: str, new_topic: Any) -> None:
    add_letter(pg_dsn, "a", offset=1, group="payments")
    set_offsets(Settings(dsn=pg_dsn, bootstrap_servers=kafka), "ledger", new_topic(1), to_earliest=True, execute=True,
                reason="test")
    for args in (("list", "--group", "paymnets"), ("list", "--group", "paymnets", "--all"),
                 ("replay", "processors:Recorder", "--group", "paymnets")):
        code, out, err = kstore("dead-letters", *args, "--dsn", pg_dsn)
        one_error_line(code, err, "group 'paymnets' has no dead letters and no stored offsets in",
                       "groups that have some: payments")
        assert out == ""
    # A group with stored offsets and no letter waiting: nothing to list or replay, and that is fine.
    code, out, err = kstore("dead-letters", "list", "--group", "ledger", "--dsn", pg_dsn)
    assert code == 0 and out.split() == ["ID", "TOPIC", "PARTITION", "OFFSET", "ATTEMPTS", "LAST_FAILURE", "STATUS",
                                         "ERROR"], (code, out, err)
    code, out, err = kstore("dead-letters", "replay", "processors:Recorder", "--group", "ledger", "--execute",
                            "--dsn", pg_dsn)
    assert code == 0 and out.startswith("replayed 0,"), (code, out, err)
    code, out, err = kstore("dead-letters", "list", "--group", "payments", "--dsn", pg_dsn)
    assert code == 0 and len(out.strip().splitlines()) == 2, (code, out, err)
