"""The dead-letter lifecycle against the real PostgreSQL (and SQLite): discard, resolve, edited replays, history.

A dead letter leaves ``dead`` once: replayed, discarded or resolved. Every change is one transaction with a
history row (who, when, why, request id); a lost COMMIT answer is read back, never assumed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import DatabaseError, Message, Settings
from kstore.db import deadletters as dl
from kstore.db.deadletters import (
    DeadLetters,
    DeadLetterStateError,
    Edit,
    build_table,
)
from kstore.db.letterquery import LetterFilter, list_dead_letters
from kstore.ops.replay import replay_dead_letters
from tests.integration.cli.test_cli import assert_one_clear_line, kstore
from tests.support.faultproxy import FaultProxy
from tests.support.lossy import CUT, Faults, lossy_engine, run_cli_in_doubt
from tests.support.processors import Recorder
from tests.unit.db.test_deadletters import ME, add_letter

REQUEST = re.compile(r"\b([0-9a-f]{32})\b")


def query(dsn: str, sql: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        rows = list(conn.execute(sa.text(sql), params))
    engine.dispose()
    return rows


def statuses(dsn: str) -> dict[int, str]:
    return {r.id: r.status for r in query(dsn, "SELECT id, status FROM kstore_dead_letters")}


def history_rows(dsn: str) -> list[Any]:
    return query(dsn, "SELECT * FROM kstore_dead_letter_history ORDER BY id")


def effect_values(dsn: str) -> list[tuple[int, str]]:
    return [(r.kafka_offset, r.value) for r in query(dsn, "SELECT kafka_offset, value FROM effects ORDER BY id")]


def test_discard_and_resolve_record_who_when_why_and_leave_the_waiting_list(pg_dsn: str) -> None:
    a, b, c, waiting = (add_letter(pg_dsn, v, offset=i) for i, v in enumerate(["a", "b", "c", "d"]))
    before = datetime.now(timezone.utc)
    r = kstore("dead-letters", "discard", "--group", "g", "--id", str(a), "--id", str(b), "--reason", "duplicate",
               "--dsn", pg_dsn)
    assert r.returncode == 0 and f"discarded 2: {a}, {b} (request " in r.stdout, r.stdout + r.stderr
    r = kstore("dead-letters", "resolve", "--group", "g", "--id", str(c), "--reason", "fixed in billing",
               "--dsn", pg_dsn)
    assert r.returncode == 0 and f"resolved 1: {c}" in r.stdout, r.stdout + r.stderr

    assert statuses(pg_dsn) == {a: "discarded", b: "discarded", c: "resolved", waiting: "dead"}
    rows = history_rows(pg_dsn)
    assert [(h.dead_letter_id, h.action, h.from_status, h.to_status, h.reason) for h in rows] == [
        (a, "discard", "dead", "discarded", "duplicate"), (b, "discard", "dead", "discarded", "duplicate"),
        (c, "resolve", "dead", "resolved", "fixed in billing")]
    assert all(f"{h.by_user}@{h.by_host}" == ME and not h.edited for h in rows)
    assert all(before - timedelta(seconds=1) <= h.at <= datetime.now(timezone.utc) for h in rows)
    assert rows[0].request_id == rows[1].request_id != rows[2].request_id, "one transaction, one request id"

    waiting_list = kstore("dead-letters", "list", "--group", "g", "--json", "--dsn", pg_dsn)
    assert [json.loads(line)["id"] for line in waiting_list.stdout.splitlines()] == [waiting]
    every = kstore("dead-letters", "list", "--group", "g", "--all", "--json", "--dsn", pg_dsn)
    assert {d["id"]: d["status"] for d in map(json.loads, every.stdout.splitlines())} == statuses(pg_dsn)
    table = kstore("dead-letters", "list", "--group", "g", "--all", "--dsn", pg_dsn).stdout.splitlines()
    assert [line.split()[7] for line in table[1:]] == ["discarded", "discarded", "resolved", "dead"]

    shown = kstore("dead-letters", "show", str(a), "--dsn", pg_dsn)
    assert shown.returncode == 0, shown.stderr
    assert "status: discarded" in shown.stdout
    assert f"dead -> discarded  by {ME}  request {rows[0].request_id}  reason: duplicate" in shown.stdout
    assert "history: none" in kstore("dead-letters", "show", str(waiting), "--dsn", pg_dsn).stdout


def test_a_discarded_letter_cannot_be_replayed_nor_a_replayed_one_discarded(pg_dsn: str) -> None:
    dropped, replayed = add_letter(pg_dsn, "dropped"), add_letter(pg_dsn, "replayed", offset=8)
    assert kstore("dead-letters", "discard", "--group", "g", "--id", str(dropped), "--reason", "spam",
                  "--dsn", pg_dsn).returncode == 0
    r = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--id", str(dropped),
               "--id", str(replayed), "--dsn", pg_dsn)
    assert_one_clear_line(r, f"cannot replay dead letter {dropped}: it was discarded by {ME} at ", "(spam)",
                          "nothing was replayed")
    assert effect_values(pg_dsn) == [] and statuses(pg_dsn)[replayed] == "dead", "refused before anything ran"

    ok = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--id", str(replayed),
                "--dsn", pg_dsn)
    assert ok.returncode == 0 and "replayed 1," in ok.stdout, ok.stdout + ok.stderr
    r = kstore("dead-letters", "discard", "--group", "g", "--id", str(replayed), "--reason", "x", "--dsn", pg_dsn)
    assert_one_clear_line(r, f"cannot discard dead letter {replayed}: it was replayed by {ME}",
                          "only a waiting (dead) letter can be discarded, nothing changed")
    r = kstore("dead-letters", "resolve", "--group", "g", "--id", str(dropped), "--reason", "x", "--dsn", pg_dsn)
    assert_one_clear_line(r, f"cannot resolve dead letter {dropped}: it was discarded")
    assert statuses(pg_dsn) == {dropped: "discarded", replayed: "replayed"}
    assert [h.action for h in history_rows(pg_dsn)] == ["discard", "replay"]
    assert effect_values(pg_dsn) == [(8, "replayed")]


def test_the_same_action_twice_changes_nothing_the_second_time(pg_dsn: str) -> None:
    a, b = add_letter(pg_dsn, "a"), add_letter(pg_dsn, "b", offset=8)
    first = kstore("dead-letters", "discard", "--group", "g", "--id", str(a), "--reason", "first", "--dsn", pg_dsn)
    again = kstore("dead-letters", "discard", "--group", "g", "--id", str(a), "--reason", "second", "--dsn", pg_dsn)
    assert first.returncode == 0 and again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"already discarded, left as they were: {a}"
    both = kstore("dead-letters", "discard", "--group", "g", "--id", str(a), "--id", str(b), "--reason", "third",
                  "--dsn", pg_dsn)
    assert both.returncode == 0 and f"discarded 1: {b}" in both.stdout and f"left as they were: {a}" in both.stdout
    assert [(h.dead_letter_id, h.reason) for h in history_rows(pg_dsn)] == [(a, "first"), (b, "third")]

    settings = Settings(dsn=pg_dsn)
    c = add_letter(pg_dsn, "c", offset=9)
    assert replay_dead_letters(settings, Recorder(), "g", [c]).replayed == [c]
    assert replay_dead_letters(settings, Recorder(), "g", [c]).skipped == [c]
    assert effect_values(pg_dsn) == [(9, "c")], "replayed once"


def test_a_discard_is_all_or_nothing(pg_dsn: str) -> None:
    dead, replayed, other = add_letter(pg_dsn, "a"), add_letter(pg_dsn, "b", offset=8), add_letter(pg_dsn, "c", "h")
    replay_dead_letters(Settings(dsn=pg_dsn), Recorder(), "g", [replayed])
    for ids, needle in [([dead, replayed], f"cannot discard dead letter {replayed}: it was replayed"),
                        ([dead, 999], "no dead letter with id 999: nothing changed"),
                        ([dead, other], f"dead letter(s) {other} are not of group 'g': nothing changed")]:
        r = kstore("dead-letters", "discard", "--group", "g", *[f"--id={i}" for i in ids], "--reason", "x",
                   "--dsn", pg_dsn)
        assert_one_clear_line(r, needle)
    assert statuses(pg_dsn) == {dead: "dead", replayed: "replayed", other: "dead"}
    assert [h.action for h in history_rows(pg_dsn)] == ["replay"]
    r = kstore("dead-letters", "discard", "--group", "g", "--id", str(dead), "--reason", " ", "--dsn", pg_dsn)
    assert_one_clear_line(r, "give a reason for the discard (--reason)")


def test_an_edited_replay_runs_the_edit_and_keeps_the_original_on_record(pg_dsn: str, tmp_path: Path) -> None:
    letter, keyed = add_letter(pg_dsn, "poison"), add_letter(pg_dsn, "fine", offset=8)
    edited = tmp_path / "fixed.txt"
    edited.write_bytes(b"fixed")
    env = {"KSTORE_TEST_FAIL_VALUE": "poison"}  # the original still fails: only the edit can succeed
    r = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--id", str(letter),
               "--value-file", str(edited), "--reason", "typo in the amount", "--dsn", pg_dsn, env=env)
    assert r.returncode == 0 and "replayed 1," in r.stdout, r.stdout + r.stderr
    assert effect_values(pg_dsn) == [(7, "fixed")]
    (row,) = query(pg_dsn, "SELECT value, key, status, attempts FROM kstore_dead_letters WHERE id = :i", i=letter)
    assert (bytes(row.value), bytes(row.key), row.status, row.attempts) == (b"poison", b"k", "replayed", 3)
    (change,) = history_rows(pg_dsn)
    assert (change.edited, bytes(change.replayed_key), bytes(change.replayed_value), change.reason) == (
        True, b"k", b"fixed", "typo in the amount")
    shown = kstore("dead-letters", "show", str(letter), "--dsn", pg_dsn).stdout
    assert "value: b'poison'" in shown and "replayed edited: key b'k' value b'fixed'" in shown, shown

    result = replay_dead_letters(Settings(dsn=pg_dsn), Recorder(), "g", [keyed], edits={keyed: Edit(key=b"k2")})
    assert result.replayed == [keyed]
    latest = history_rows(pg_dsn)[-1]
    assert (bytes(latest.replayed_key), bytes(latest.replayed_value)) == (b"k2", b"fine")
    assert effect_values(pg_dsn)[-1] == (8, "fine")


def test_edit_options_are_checked_before_anything_runs(pg_dsn: str, tmp_path: Path) -> None:
    a, b = add_letter(pg_dsn, "a"), add_letter(pg_dsn, "b", offset=8)
    base = ["dead-letters", "replay", "processors:Recorder", "--group", "g", "--dsn", pg_dsn]
    assert_one_clear_line(kstore(*base, "--value", "x"), "needs exactly one --id")
    assert_one_clear_line(kstore(*base, "--id", str(a), "--id", str(b), "--key", "x"), "needs exactly one --id")
    assert_one_clear_line(kstore(*base, "--id", str(a), "--value", "x", "--value-file", "f"),
                          "give --value or --value-file, not both")
    assert_one_clear_line(kstore(*base, "--id", str(a), "--value-file", str(tmp_path / "missing")),
                          "cannot read --value-file", "No such file")
    assert statuses(pg_dsn) == {a: "dead", b: "dead"} and effect_values(pg_dsn) == []


@pytest.fixture
def lossy(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """Dead-letter commands in this process on lossy engines (tests/support/lossy.py)."""
    faults = Faults()
    monkeypatch.setattr(dl, "make_engine", lambda s: lossy_engine(s, faults))
    return faults


def assert_cut(faults: Faults, expected: list[str], *tables: str) -> None:
    """The faults so far all fired, each on the COMMIT of the change (a transaction writing ``tables``)."""
    assert [c.fault for c in faults.cut] == expected, faults.cut
    for cut in faults.cut:
        assert all(cut.wrote(table) for table in tables), cut.statements


def test_a_discard_whose_commit_answer_is_lost_is_read_back(pg_dsn: str, lossy: Faults) -> None:
    a = add_letter(pg_dsn, "a")
    lossy.commits.append("refused")  # did not land: says so, and running it again is safe
    with pytest.raises(DatabaseError, match=f"did not land \\({CUT}\\): nothing changed; it is safe to run it again"):
        dl.discard_dead_letters(Settings(dsn=pg_dsn), "g", [a], "spam")
    assert_cut(lossy, ["refused"], "kstore_dead_letters", "kstore_dead_letter_history")
    assert statuses(pg_dsn) == {a: "dead"} and history_rows(pg_dsn) == []

    lossy.commits.append("lost")  # landed: reported as done, so nobody runs it again
    done = dl.discard_dead_letters(Settings(dsn=pg_dsn), "g", [a], "spam")
    assert_cut(lossy, ["refused", "lost"], "kstore_dead_letters", "kstore_dead_letter_history")
    assert done.changed == [a]
    (change,) = history_rows(pg_dsn)
    assert (change.request_id, change.to_status) == (done.request_id, "discarded")
    again = dl.discard_dead_letters(Settings(dsn=pg_dsn), "g", [a], "spam")
    assert (again.changed, again.already) == ([], [a])


def test_an_edited_replay_whose_commit_answer_is_lost_lands_once(pg_dsn: str, lossy: Faults) -> None:
    a = add_letter(pg_dsn, "poison")
    lossy.commits.append("lost")
    result = replay_dead_letters(Settings(dsn=pg_dsn), Recorder(), "g", [a], edits={a: Edit(value=b"fixed")})
    assert_cut(lossy, ["lost"], "effects", "kstore_dead_letters", "kstore_dead_letter_history")
    assert (result.replayed, result.failed) == ([a], {})
    assert effect_values(pg_dsn) == [(7, "fixed")]
    assert statuses(pg_dsn) == {a: "replayed"}
    assert [(h.edited, bytes(h.replayed_value)) for h in history_rows(pg_dsn)] == [(True, b"fixed")]
    assert replay_dead_letters(Settings(dsn=pg_dsn), Recorder(), "g", [a]).skipped == [a]
    assert effect_values(pg_dsn) == [(7, "fixed")]


@pytest.mark.parametrize("command", ["resolve", "replay"])
def test_a_cli_change_that_cannot_be_read_back_is_one_line_and_exit_3(pg_dsn: str, command: str) -> None:
    a = add_letter(pg_dsn, "a")
    args: Sequence[str] = (["resolve", "--reason", "done by hand"] if command == "resolve"
                           else ["replay", "processors:Recorder", "--value", "edited"])
    r = run_cli_in_doubt("kstore.db.deadletters", "dead-letters", *args, "--group", "g", "--id", str(a),
                         "--dsn", pg_dsn)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("kstore: error: ") and "may or may not have landed" in line, line
    assert f"`kstore dead-letters show {a}`" in line and "Traceback" not in r.stderr and r.stdout == "", line
    match = REQUEST.search(line)
    assert match, line
    # It did land (the server committed): show names the same request.
    shown = kstore("dead-letters", "show", str(a), "--dsn", pg_dsn)
    assert f"request {match.group(1)}" in shown.stdout, shown.stdout
    assert statuses(pg_dsn) == {a: "resolved" if command == "resolve" else "replayed"}
    assert (command == "replay") == (effect_values(pg_dsn) == [(7, "edited")])


def test_a_resolve_through_a_real_cut_after_commit_lands_once(pg_dsn: str) -> None:
    """Through tests/support/faultproxy.py: the COMMIT reaches the server, then the TCP connection is reset."""
    a, b = add_letter(pg_dsn, "a"), add_letter(pg_dsn, "b", offset=8)
    url = sa.engine.make_url(pg_dsn)
    with FaultProxy(str(url.host), int(url.port or 5432)) as proxy:
        letters = DeadLetters(Settings(dsn=proxy.dsn_through(pg_dsn)))  # connects once (migration check) first
        try:
            proxy.cut_after_commit()
            done = letters.resolve([a, b], "fixed upstream", group="g")
        finally:
            letters.close()
        assert proxy.commits_cut == 1
    assert done.changed == [a, b]
    assert statuses(pg_dsn) == {a: "resolved", b: "resolved"}
    assert [(h.dead_letter_id, h.request_id) for h in history_rows(pg_dsn)] == [
        (a, done.request_id), (b, done.request_id)]


class DiscardedMeanwhile(Recorder):
    """Writes its effect, then (while the replay holds the letter) an operator tries to discard it elsewhere."""

    dsn = ""
    refused: list[str] = []

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        super().handle_batch(msgs)
        try:
            dl.discard_dead_letters(Settings(dsn=self.dsn), "g", [int(msgs[0].value)], "raced")
        except DeadLetterStateError as exc:
            self.refused.append(str(exc))


def test_a_letter_cannot_be_discarded_while_its_replay_runs(pg_dsn: str) -> None:
    a = add_letter(pg_dsn, "0")
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:  # the value names the letter, for the processor
        conn.execute(sa.text("UPDATE kstore_dead_letters SET value = :v WHERE id = :i"), {"v": str(a).encode(), "i": a})
    engine.dispose()
    proc = DiscardedMeanwhile()
    proc.dsn = pg_dsn
    assert replay_dead_letters(Settings(dsn=pg_dsn), proc, "g", [a]).replayed == [a]
    assert proc.refused == [f"dead letter(s) {a}: another operator is replaying or changing it right now; nothing was "
                            f"done (see `kstore dead-letters show {a}` once they are done)"]
    assert effect_values(pg_dsn) == [(7, str(a))]
    assert statuses(pg_dsn) == {a: "replayed"}
    assert [h.action for h in history_rows(pg_dsn)] == ["replay"]


def test_a_replay_that_fails_again_updates_its_letter(pg_dsn: str) -> None:
    a = add_letter(pg_dsn, "poison")
    (before,) = query(pg_dsn, "SELECT * FROM kstore_dead_letters")
    env = {"KSTORE_TEST_FAIL_VALUE": "poison"}
    for attempt in (1, 2):
        r = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--reason", f"try {attempt}",
                   "--execute", "--dsn", pg_dsn, env=env)
        assert r.returncode == 1 and f"dead letter {a} failed again: ValueError: poison message" in r.stderr, r.stderr
    (after,) = query(pg_dsn, "SELECT * FROM kstore_dead_letters")  # one letter for the message, not three
    assert (after.id, after.status, after.attempts) == (a, "dead", before.attempts + 2)
    assert after.error == "ValueError: poison message at t[0] offset 7"
    assert "Traceback" in after.traceback and "poison message at t[0] offset 7" in after.traceback
    assert after.first_failure_at == before.first_failure_at < after.last_failure_at
    assert [(h.action, h.from_status, h.to_status, h.reason) for h in history_rows(pg_dsn)] == [
        ("replay", "dead", "dead", "try 1"), ("replay", "dead", "dead", "try 2")]
    shown = kstore("dead-letters", "show", str(a), "--dsn", pg_dsn).stdout
    assert "dead -> dead" in shown and "the replay failed" in shown, shown
    assert effect_values(pg_dsn) == []
    fixed = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--execute", "--dsn", pg_dsn)
    assert fixed.returncode == 0 and "replayed 1," in fixed.stdout, fixed.stdout + fixed.stderr
    assert statuses(pg_dsn) == {a: "replayed"} and effect_values(pg_dsn) == [(7, "poison")]


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_a_letter_whose_replay_fails_otherwise_is_still_found_by_the_error_that_made_it_dead(
        db: str, pg_dsn: str, sqlite_dsn: str) -> None:
    dsn = pg_dsn if db == "postgresql" else sqlite_dsn
    a = add_letter(dsn, "poison")
    engine = sa.create_engine(dsn)
    with engine.begin() as conn:  # as a record that did not decode is dead-lettered
        conn.execute(build_table().update().values(error="DeserializationError: not JSON"))
    engine.dispose()
    for attempt in (1, 2):
        r = kstore("dead-letters", "replay", "processors:Recorder", "--group", "g", "--reason", f"try {attempt}",
                   "--execute", "--dsn", dsn, env={"KSTORE_TEST_FAIL_VALUE": "poison"})
        assert r.returncode == 1 and "failed again: ValueError" in r.stderr, r.stderr
    settings = Settings(dsn=dsn)
    for error_type in ("DeserializationError", "ValueError"):
        found = list_dead_letters(settings, "g", LetterFilter(error_type=error_type), 10, 0)
        assert [d.id for d in found.letters] == [a], error_type
    assert [d.id for d in list_dead_letters(settings, "g", LetterFilter(error="not json"), 10, 0).letters] == [a]
    [letter] = list_dead_letters(settings, "g", LetterFilter(), 10, 0).letters
    assert letter.error == "ValueError: poison message at t[0] offset 7"
    assert letter.first_error == "DeserializationError: not JSON"  # kept through the second failure too
    shown = kstore("dead-letters", "show", str(a), "--dsn", dsn).stdout
    assert "first_error: DeserializationError: not JSON" in shown, shown


def test_a_message_dead_lettered_again_after_a_rewind_updates_its_waiting_letter(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(1), "again"
    produce(topic, ["v0", "poison", "v2"])
    args = ["--on-error", "dead_letter", "--max-attempts", "2"]
    env = {"KSTORE_TEST_FAIL_VALUE": "poison"}
    w = workers(pg_dsn, topic, group, env=env, args=args)
    w.wait_for_log(r"dead-lettered .* offset 1 after 2 attempt")
    assert w.terminate() == 0
    (first,) = query(pg_dsn, "SELECT * FROM kstore_dead_letters")
    r = kstore("offsets", "set", "--group", group, "--topic", topic, "--to-offset", "0", "--reason", "again",
               "--bootstrap-servers", kafka, "--execute", "--dsn", pg_dsn)
    assert r.returncode == 0, r.stderr
    w = workers(pg_dsn, topic, group, env=env, args=args)
    w.wait_for_log(r"dead-lettered .* offset 1 after 2 attempt")
    assert w.terminate() == 0
    (again,) = query(pg_dsn, "SELECT * FROM kstore_dead_letters")  # the same letter, not a second one
    assert (again.id, again.offset, again.status, again.attempts) == (first.id, 1, "dead", 4)
    assert again.first_failure_at == first.first_failure_at < again.last_failure_at
