"""Operator writes whose COMMIT's answer is lost, against the real PostgreSQL: landed, not landed, unknown.

Resets (``Store.reset``, ``kstore offsets set``) and dead-letter replays read the
outcome back on a fresh connection; they never assume either way. The faults are
real: see tests/support/lossy.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

import kstore.db.deadletters
import kstore.ops.offsets
from kstore import CommitInDoubtError, DatabaseError, Settings
from kstore.db.deadletters import build_table
from kstore.db.store import Store, make_engine
from kstore.ops.offsets import set_offsets
from kstore.ops.replay import replay_matching
from tests.support.faultproxy import FaultProxy
from tests.support.harness import REPO_DIR, SUPPORT_DIR, effects, stored_offsets
from tests.support.lossy import CUT, Faults, lossy_engine, run_cli_in_doubt
from tests.support.processors import Recorder

REQUEST_ID = re.compile(r"request id ([0-9a-f]{32})")


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def lossy_store(pg_dsn: str, faults: Faults) -> Iterator[Store]:
    settings = Settings(dsn=pg_dsn)
    engine = lossy_engine(settings, faults)
    store = Store(engine, settings)
    store.reset("g", ("t", 0), 10, expected_epoch=None, reason="setup")
    yield store
    engine.dispose()


def history(dsn: str, group: str = "g") -> list[Any]:
    settings = Settings(dsn=dsn)
    engine = make_engine(settings)
    try:
        return Store(engine, settings).history_entries(group)
    finally:
        engine.dispose()


def test_reset_whose_commit_answer_was_lost_but_landed_returns_its_epoch(
        pg_dsn: str, lossy_store: Store, faults: Faults, caplog: pytest.LogCaptureFixture) -> None:
    faults.commits.append("lost")
    with caplog.at_level(logging.WARNING, logger="kstore"):
        epoch = lossy_store.reset("g", ("t", 0), 5, expected_epoch=None, reason="admin")
    assert_cut_the_reset(faults, "lost")
    assert epoch == 2
    assert stored_offsets(pg_dsn, "g") == {("t", 0): 5}
    latest, setup = history(pg_dsn)
    assert (latest.from_offset, latest.to_offset, latest.epoch, latest.reason) == (10, 5, 2, "admin")
    assert latest.request_id and re.fullmatch("[0-9a-f]{32}", latest.request_id)
    assert latest.request_id != setup.request_id
    assert f"reset {latest.request_id} of t[0] in group 'g': the answer to its COMMIT was lost ({CUT}), " \
           "but reading it back shows it landed" in caplog.text


def test_reset_that_cannot_be_read_back_is_in_doubt(pg_dsn: str, lossy_store: Store, faults: Faults) -> None:
    faults.commits.append("lost")
    faults.down_after_fault = True
    with pytest.raises(CommitInDoubtError) as raised:
        lossy_store.reset("g", ("t", 0), 5, expected_epoch=None, reason="admin")
    assert_cut_the_reset(faults, "lost")
    message = str(raised.value)
    assert "\n" not in message and "may or may not have landed" in message, message
    assert "`kstore offsets history --group g`" in message and "Connection refused" in message, message
    assert faults.refused_connections == 5, "read back five times, each on a fresh connection"
    match = REQUEST_ID.search(message)
    assert match, message
    # It did land here (the server committed): the history shows it under that request id.
    assert history(pg_dsn)[0].request_id == match.group(1)
    assert stored_offsets(pg_dsn, "g") == {("t", 0): 5}


@pytest.fixture
def lossy_admin(monkeypatch: pytest.MonkeyPatch, faults: Faults) -> Faults:
    """``kstore offsets set`` and ``kstore dead-letters replay`` (in this process) on lossy engines."""
    monkeypatch.setattr(kstore.ops.offsets, "make_engine", lambda s: lossy_engine(s, faults))
    monkeypatch.setattr(kstore.db.deadletters, "make_engine", lambda s: lossy_engine(s, faults))
    return faults


def test_shift_by_whose_commit_is_lost_never_shifts_twice(pg_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                                          lossy_admin: Faults) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(100)))
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka)
    set_offsets(settings, "g", topic, to_offset=60, execute=True, reason="test")

    lossy_admin.commits.append("refused")  # did not land: says so; running it again shifts once
    with pytest.raises(DatabaseError, match=f"did not land \\({CUT}\\): nothing changed; it is safe to run it again"):
        set_offsets(settings, "g", topic, shift_by=-10, execute=True, reason="test")
    assert_cut_the_reset(lossy_admin, "refused")
    assert stored_offsets(pg_dsn, "g") == {(topic, 0): 60}
    plan = set_offsets(settings, "g", topic, shift_by=-10, execute=True, reason="test")
    assert [(p.from_offset, p.to_offset) for p in plan] == [(60, 50)]

    lossy_admin.commits.append("lost")  # landed: reported as applied, so nobody runs it again
    plan = set_offsets(settings, "g", topic, shift_by=-10, execute=True, reason="test")
    assert_cut_the_reset(lossy_admin, "refused", "lost")
    assert [(p.from_offset, p.to_offset) for p in plan] == [(50, 40)]
    assert stored_offsets(pg_dsn, "g") == {(topic, 0): 40}
    assert [(h.from_offset, h.to_offset) for h in history(pg_dsn)] == [(50, 40), (60, 50), (None, 60)]


def assert_cut_the_reset(faults: Faults, *expected: str) -> None:
    """The faults so far all fired, each on the COMMIT of a reset (its offsets and its history row)."""
    assert [c.fault for c in faults.cut] == list(expected), faults.cut
    for cut in faults.cut:
        assert cut.wrote("kstore_offsets") and cut.wrote("kstore_offset_history"), cut.statements


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``args`` run with this checkout's kstore (whatever is installed) and tests/ importable."""
    path = os.pathsep.join([str(SUPPORT_DIR), str(REPO_DIR)])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=SUPPORT_DIR,
                          env={**os.environ, "PYTHONPATH": path})


def test_cli_reset_in_doubt_is_one_line_and_history_shows_its_request_id(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(100)))
    set_offsets(Settings(dsn=pg_dsn, bootstrap_servers=kafka), "g", topic, to_offset=60, execute=True, reason="test")
    r = run_cli_in_doubt("kstore.ops.offsets", "offsets", "set", "--group", "g", "--topic", topic, "--shift-by", "-10",
                "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--reason", "replay", "--execute")
    print(r.stdout + r.stderr)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("kstore: error: reset ") and "may or may not have landed" in line, line
    assert "Traceback" not in r.stderr and r.stdout == ""
    match = REQUEST_ID.search(line)
    assert match, line

    shown = run_cli("-m", "kstore", "offsets", "history", "--group", "g", "--dsn", pg_dsn, "--json")
    assert shown.returncode == 0, shown.stderr
    latest = json.loads(shown.stdout)[0]
    assert (latest["request_id"], latest["from_offset"], latest["to_offset"]) == (match.group(1), 60, 50)
    table = run_cli("-m", "kstore", "offsets", "history", "--group", "g", "--dsn", pg_dsn)
    header, newest = table.stdout.splitlines()[:2]
    assert header.split()[7] == "REQUEST" and match.group(1) in newest.split(), table.stdout


def add_dead_letter(dsn: str, group: str, value: str) -> int:
    engine = sa.create_engine(dsn)
    stamp = datetime.now(timezone.utc)
    with engine.begin() as conn:
        letter_id = conn.execute(build_table().insert().values(
            consumer_group=group, topic="t", partition_id=0, offset=7, key=None, value=value.encode(), headers="[]",
            timestamp=None, error="ValueError: boom", traceback="Traceback ...", attempts=3, first_failure_at=stamp,
            last_failure_at=stamp, status="dead",
        ).returning(build_table().c.id)).scalar_one()
    engine.dispose()
    return int(letter_id)


def letter_state(dsn: str, letter_id: int) -> tuple[str, int]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT status, attempts FROM kstore_dead_letters WHERE id = :i"),
                           {"i": letter_id}).one()
    engine.dispose()
    return row[0], row[1]


def test_replay_whose_commit_answer_was_lost_counts_as_replayed_once(pg_dsn: str, lossy_admin: Faults) -> None:
    letter = add_dead_letter(pg_dsn, "g", "poison")
    lossy_admin.commits.append("lost")
    result = replay_matching(Settings(dsn=pg_dsn), Recorder(), "g")
    assert_cut_the_replay(lossy_admin, "lost")
    assert (result.done, result.failed) == (1, 0)
    assert letter_state(pg_dsn, letter) == ("replayed", 3)
    assert effects(pg_dsn) == {("t", 0, 7): 1}


def assert_cut_the_replay(faults: Faults, *expected: str) -> None:
    """The faults all fired, each on the COMMIT of a replay: its effect and its letter's new status."""
    assert [c.fault for c in faults.cut] == list(expected), faults.cut
    for cut in faults.cut:
        assert cut.wrote("effects") and cut.wrote("kstore_dead_letters"), cut.statements


def test_replay_whose_commit_did_not_land_is_tried_again_and_lands_once(pg_dsn: str, lossy_admin: Faults) -> None:
    """A lost connection is not the letter's fault: the walk tries the letter again, it counts no failure."""
    letter = add_dead_letter(pg_dsn, "g", "poison")
    lossy_admin.commits.append("refused")
    result = replay_matching(Settings(dsn=pg_dsn), Recorder(), "g")
    assert_cut_the_replay(lossy_admin, "refused")
    assert (result.done, result.failed) == (1, 0)
    assert letter_state(pg_dsn, letter) == ("replayed", 3)
    assert effects(pg_dsn) == {("t", 0, 7): 1}


def test_replay_that_cannot_be_read_back_is_in_doubt(pg_dsn: str, lossy_admin: Faults) -> None:
    letter = add_dead_letter(pg_dsn, "g", "poison")
    lossy_admin.commits.append("lost")
    lossy_admin.down_after_fault = True
    with pytest.raises(CommitInDoubtError, match=f"`kstore dead-letters show {letter}`") as raised:
        replay_matching(Settings(dsn=pg_dsn), Recorder(), "g")
    assert_cut_the_replay(lossy_admin, "lost")
    assert "may or may not have landed" in str(raised.value) and "\n" not in str(raised.value)
    assert letter_state(pg_dsn, letter) == ("replayed", 3), "it landed; no failure was counted"
    assert effects(pg_dsn) == {("t", 0, 7): 1}


def test_reset_through_a_real_cut_after_commit_lands_once(pg_dsn: str) -> None:
    """The same through tests/support/faultproxy.py: the COMMIT reaches the server, then the TCP connection is reset."""
    url = sa.engine.make_url(pg_dsn)
    with FaultProxy(str(url.host), int(url.port or 5432)) as proxy:
        settings = Settings(dsn=proxy.dsn_through(pg_dsn))
        engine = make_engine(settings)
        store = Store(engine, settings)
        try:
            store.reset("g", ("t", 0), 10, expected_epoch=None, reason="setup")
            proxy.cut_after_commit()
            assert store.reset("g", ("t", 0), 5, expected_epoch=None, reason="admin") == 2
        finally:
            engine.dispose()
        assert proxy.commits_cut == 1
    assert stored_offsets(pg_dsn, "g") == {("t", 0): 5}
    assert [(h.to_offset, h.epoch) for h in history(pg_dsn)] == [(5, 2), (10, 1)]
