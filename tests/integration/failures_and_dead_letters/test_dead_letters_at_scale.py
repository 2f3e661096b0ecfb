"""`kstore dead-letters` over many letters, against the real PostgreSQL: one command replays, discards or
resolves every letter a filter matches (a dry run first, `--execute` to act), walking them by id so that
letters which keep failing never hold up the ones after them; `list` pages by id with a total and how many
more, filtered the same way, as a table or JSON lines.

The letters are written with the worker's own write (:func:`kstore.db.deadletters.write`), many in one
transaction, rather than run through a worker one by one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from kstore import Message, Settings
from kstore.cli import cli
from kstore.errors import DatabaseError
from kstore.ops.replay import replay_matching
from tests.integration.cli.test_cli import assert_one_clear_line
from tests.support.harness import SUPPORT_DIR, wait_until
from tests.support.processors import Recorder
from tests.unit.db.test_letterquery import dead_letter

POISON = {"KSTORE_TEST_FAIL_VALUE": "poison"}
SHOWN = re.compile(r"^(\d+) of (\d+) shown \(ids (\d+)\.\.(\d+)\); (?:no more|(\d+) more: add --after (\d+))$")


@pytest.fixture(autouse=True)
def in_tests_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `kstore dead-letters replay processors:Recorder` finds the processor, as from a shell there."""
    monkeypatch.chdir(SUPPORT_DIR)


def kstore(*args: str, env: dict[str, str] | None = None, timeout: float = 0) -> subprocess.CompletedProcess[str]:
    """``kstore ARGS`` run in this process: its exit code, stdout and stderr (a new process would spend
    seconds importing on a busy machine, for each of the many commands these tests run)."""
    r = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return subprocess.CompletedProcess(["kstore", *args], r.exit_code, r.stdout, r.stderr)


def rows(dsn: str, sql: str) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql)))
    finally:
        engine.dispose()


def statuses(dsn: str) -> dict[int, str]:
    return {r.id: r.status for r in rows(dsn, "SELECT id, status FROM kstore_dead_letters")}


def page_line(stderr: str) -> tuple[int, int, int, int, int, int | None]:
    """shown, total, first id, last id, more, and the next --after, from the line after a listing."""
    m = SHOWN.match(stderr.strip().splitlines()[-1])
    assert m, stderr
    shown, total, first, last, more, after = m.groups()
    return int(shown), int(total), int(first), int(last), int(more or 0), None if after is None else int(after)


def test_one_replay_replays_every_letter_past_150_that_keep_failing_at_the_head(pg_dsn: str) -> None:
    ids = dead_letter(pg_dsn, 1000, value=lambda i: "poison" if i < 150 else f"ok-{i}")
    bad, good = ids[:150], ids[150:]

    dry = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--dsn", pg_dsn, env=POISON)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.splitlines() == [f"would replay 1000 waiting dead letter(s) of 'g' (ids {ids[0]}..{ids[-1]})",
                                       "dry run: nothing changed; add --execute to replay them"]
    assert set(statuses(pg_dsn).values()) == {"dead"} and not rows(pg_dsn, "SELECT * FROM effects")
    assert not rows(pg_dsn, "SELECT * FROM kstore_dead_letter_history")

    r = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--reason", "fixed the parser",
               "--execute", "--dsn", pg_dsn, env=POISON)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"replayed 850, failed 150, skipped 0, remaining 0 (ids {ids[0]}..{ids[-1]})"]
    said = r.stderr.splitlines()
    assert said[0] == "50 more failed again than listed below; they stay dead: kstore dead-letters list --group g"
    assert said[1] == f"dead letter {bad[0]} failed again: ValueError: poison message at orders[0] offset 0"
    assert len(said) == 101 and "Traceback" not in r.stderr

    now = statuses(pg_dsn)
    assert {i for i, s in now.items() if s == "replayed"} == set(good)
    assert {i for i, s in now.items() if s == "dead"} == set(bad)
    effects = rows(pg_dsn, "SELECT kafka_offset, count(*) AS n FROM effects GROUP BY kafka_offset")
    assert {e.kafka_offset: e.n for e in effects} == {i: 1 for i in range(150, 1000)}, "each good letter once"
    attempts = rows(pg_dsn, "SELECT attempts, count(*) AS n FROM kstore_dead_letters WHERE status = 'dead' "
                            "GROUP BY attempts")
    assert [(a.attempts, a.n) for a in attempts] == [(2, 150)], "each bad one took the failed replay once"
    history = rows(pg_dsn, "SELECT to_status, reason, count(*) AS n FROM kstore_dead_letter_history "
                           "GROUP BY to_status, reason ORDER BY to_status")
    assert [(h.to_status, h.reason, h.n) for h in history] == [("dead", "fixed the parser", 150),
                                                              ("replayed", "fixed the parser", 850)]

    again = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--execute", "--dsn", pg_dsn)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines() == [f"replayed 150, failed 0, skipped 0, remaining 0 (ids {bad[0]}..{bad[-1]})"]
    assert set(statuses(pg_dsn).values()) == {"replayed"}
    assert len(rows(pg_dsn, "SELECT * FROM effects")) == 1000


def test_a_replay_walk_goes_on_past_letters_that_fail_again_a_page_at_a_time(
        pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the library, pages of 7: every third letter fails; none is tried twice, all are reached."""
    ids = dead_letter(pg_dsn, 60, value=lambda i: "poison" if i % 3 == 0 else f"ok-{i}")
    monkeypatch.setenv("KSTORE_TEST_FAIL_VALUE", "poison")  # read by Recorder.setup(), which the replay runs
    done = replay_matching(Settings(dsn=pg_dsn), Recorder(), "g", size=7)
    assert (done.done, done.failed, done.skipped, done.remaining) == (40, 20, 0, 0)
    assert (done.first_id, done.last_id) == (ids[0], ids[-1])
    assert sorted(done.failures) == ids[::3]
    assert [r.attempts for r in rows(pg_dsn, "SELECT attempts FROM kstore_dead_letters WHERE status = 'dead'")] \
        == [2] * 20, "a letter that failed again was not tried again in the same walk"


class CutsItsConnection(Recorder):
    """Recorder, but the message valued "cut" ends its own database session (as a failover or a
    restart would): an outage in the middle of the replay, not something wrong with the letter."""

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        if any(m.value == "cut" for m in msgs):
            self.session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
        super().handle_batch(msgs)


def test_a_database_outage_stops_a_replay_walk_and_fails_no_letter(pg_dsn: str) -> None:
    """The walk tries the letter again, then stops at the outage with one line saying how far it got;
    the letter it was on is not counted as failed (its attempts stay); running it again goes on with the rest."""
    ids = dead_letter(pg_dsn, 10, value=lambda i: "cut" if i == 4 else f"ok-{i}")
    with pytest.raises(DatabaseError) as stopped:
        replay_matching(Settings(dsn=pg_dsn), CutsItsConnection(), "g", size=3)
    assert str(stopped.value).startswith(f"the database failed while replaying dead letter {ids[4]} (3 tries): ")
    assert "before it this command replayed 4, failed 0, skipped 0" in str(stopped.value)
    letter = rows(pg_dsn, f"SELECT status, attempts FROM kstore_dead_letters WHERE id = {ids[4]}")[0]
    assert (letter.status, letter.attempts) == ("dead", 1)
    assert not rows(pg_dsn, f"SELECT * FROM kstore_dead_letter_history WHERE dead_letter_id = {ids[4]}")
    again = replay_matching(Settings(dsn=pg_dsn), Recorder(), "g")
    assert (again.done, again.failed, again.skipped) == (6, 0, 0)
    assert len(rows(pg_dsn, "SELECT * FROM effects")) == 10


def test_a_walk_skips_the_letter_another_operator_is_replaying_and_goes_on(pg_dsn: str, tmp_path: Path) -> None:
    ids = dead_letter(pg_dsn, 250)
    held = ids[120]
    # That replay waits inside its transaction, which holds the letter's lock, while the pause file exists.
    pause = tmp_path / "pause"
    pause.touch()
    first = subprocess.Popen(
        [sys.executable, "-m", "kstore", "dead-letters", "replay", "processors:Recorder", "--group", "g", "--id",
         str(held), "--dsn", pg_dsn], cwd=SUPPORT_DIR, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR), "KSTORE_TEST_PAUSE_FILE": str(pause),
             "KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": "120000"})
    try:
        wait_until(lambda: Path(f"{pause}.batch").exists() or first.poll() is not None, 60,
                   what="the other operator's replay inside its transaction")
        assert first.poll() is None, first.communicate()
        r = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--partition", "0", "--execute",
                   "--dsn", pg_dsn)
        assert r.stdout.splitlines() == [f"replayed 83, failed 0, skipped 1, remaining 0 (ids {ids[0]}..{ids[-1]})"]
        r = kstore("dead-letters", "discard", "--group", "g", "--reason", "test traffic", "--execute", "--dsn", pg_dsn)
        assert r.stdout.splitlines() == [f"discarded 166, skipped 1, remaining 0 (ids {ids[1]}..{ids[-2]})"]
        assert first.poll() is None, "the walks went on while the other replay still held its letter"
    finally:
        pause.unlink()
    assert first.wait(120) == 0, first.communicate()
    now = statuses(pg_dsn)
    assert now[held] == "replayed" and sorted(now.values()).count("replayed") == 84
    assert sorted(now.values()).count("discarded") == 166
    effects = rows(pg_dsn, "SELECT kafka_offset, count(*) AS n FROM effects GROUP BY kafka_offset")
    assert {e.kafka_offset: e.n for e in effects} == {i: 1 for i in range(0, 250, 3)}, "each replayed once"


def test_list_pages_by_id_with_the_total_and_how_many_more(pg_dsn: str) -> None:
    ids = dead_letter(pg_dsn, 1000, topic=lambda i: "orders" if i % 2 else "refunds")

    first = kstore("dead-letters", "list", "--group", "g", "--limit", "300", "--dsn", pg_dsn)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].split() == ["ID", "TOPIC", "PARTITION", "OFFSET", "ATTEMPTS", "LAST_FAILURE", "STATUS", "ERROR"]
    assert [int(line.split()[0]) for line in lines[1:]] == ids[:300]
    assert first.stderr.strip() == f"300 of 1000 shown (ids {ids[0]}..{ids[299]}); 700 more: add --after {ids[299]}"

    seen: list[int] = []
    after: int | None = 0
    while after is not None:
        r = kstore("dead-letters", "list", "--group", "g", "--limit", "300", "--after", str(after), "--json",
                   "--dsn", pg_dsn)
        assert r.returncode == 0, r.stderr
        letters = [json.loads(line) for line in r.stdout.splitlines()]
        shown, total, low, high, more, after = page_line(r.stderr)
        assert (shown, total, low, high) == (len(letters), 1000, letters[0]["id"], letters[-1]["id"])
        assert more == 1000 - len(seen) - shown
        seen += [d["id"] for d in letters]
    assert seen == ids, "the pages hold every letter once, in id order"
    assert r.stderr.strip().endswith("; no more") and shown == 100

    refunds = kstore("dead-letters", "list", "--group", "g", "--topic", "refunds", "--partition", "1", "--limit", "5",
                     "--json", "--dsn", pg_dsn)
    picked = [json.loads(line) for line in refunds.stdout.splitlines()]
    assert [(d["topic"], d["partition"]) for d in picked] == [("refunds", 1)] * 5
    assert page_line(refunds.stderr)[1] == len([i for i in range(1000) if i % 2 == 0 and i % 3 == 1])
    past = kstore("dead-letters", "list", "--group", "g", "--after", str(ids[-1]), "--dsn", pg_dsn)
    assert past.returncode == 0 and past.stderr.strip() == f"none of 1000 matching after id {ids[-1]}", past.stderr


def test_discard_by_error_text_dry_runs_first_and_then_discards_every_match(pg_dsn: str) -> None:
    def error(i: int) -> Exception:
        return KeyError("sku-404") if i % 4 == 0 else ValueError(f"bad quantity in order {i}")

    ids = dead_letter(pg_dsn, 1000, error=error)
    unknown = {ids[i] for i in range(0, 1000, 4)}

    dry = kstore("dead-letters", "discard", "--group", "g", "--error", "SKU-404", "--dsn", pg_dsn)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.splitlines() == [f"would discard 250 waiting dead letter(s) of 'g' (ids {min(unknown)}.."
                                       f"{max(unknown)})", "dry run: nothing changed; add --execute to discard them"]
    assert set(statuses(pg_dsn).values()) == {"dead"}
    assert not rows(pg_dsn, "SELECT * FROM kstore_dead_letter_history")

    unreasoned = kstore("dead-letters", "discard", "--group", "g", "--error", "SKU-404", "--execute", "--dsn", pg_dsn)
    assert_one_clear_line(unreasoned, "give a reason for the discard (--reason)")
    both = kstore("dead-letters", "discard", "--group", "g", "--id", str(ids[0]), "--topic", "orders",
                  "--reason", "x", "--dsn", pg_dsn)
    assert_one_clear_line(both, "give --id or filters")
    assert set(statuses(pg_dsn).values()) == {"dead"}

    r = kstore("dead-letters", "discard", "--group", "g", "--error-type", "KeyError", "--reason",
               "products not sold any more", "--execute", "--dsn", pg_dsn)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"discarded 250, skipped 0, remaining 0 (ids {min(unknown)}..{max(unknown)})"]
    now = statuses(pg_dsn)
    assert {i for i, s in now.items() if s == "discarded"} == unknown
    assert {i for i, s in now.items() if s == "dead"} == set(ids) - unknown
    history = rows(pg_dsn, "SELECT dead_letter_id, reason, request_id FROM kstore_dead_letter_history")
    assert {h.dead_letter_id for h in history} == unknown
    assert {h.reason for h in history} == {"products not sold any more"}
    assert len({h.request_id for h in history}) == 3, "a transaction (and request id) per page of 100"

    resolved = kstore("dead-letters", "resolve", "--group", "g", "--reason", "refunded by hand", "--execute",
                      "--dsn", pg_dsn)
    assert resolved.stdout.splitlines() == [f"resolved 750, skipped 0, remaining 0 (ids {ids[1]}..{ids[-1]})"]
    assert sorted(statuses(pg_dsn).values()) == ["discarded"] * 250 + ["resolved"] * 750


def test_an_unknown_group_is_one_line_for_a_filtered_replay_and_list(pg_dsn: str) -> None:
    dead_letter(pg_dsn, 3)
    for args in (["list"], ["replay", "processors:Recorder", "--execute"], ["discard", "--topic", "orders"]):
        r = kstore("dead-letters", *args, "--group", "gg", "--dsn", pg_dsn)
        assert_one_clear_line(r, "group 'gg' has no dead letters and no stored offsets", "groups that have some: g")
    assert set(statuses(pg_dsn).values()) == {"dead"}
