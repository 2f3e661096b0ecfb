"""Two `kstore dead-letters replay --execute` walks over the same letters at once, on PostgreSQL: each
letter is replayed by exactly one of them, and its effect lands once.

Each process has its own processor; the database locks a letter for the replay that runs it, and the
other walk skips it (:mod:`tests.support.replay_processors` logs each handler's time and process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.harness import SUBPROCESS_PATH, SUPPORT_DIR
from tests.support.replay_processors import LOG_ENV, SlowReplay, Step, dead_letter, steps

pytestmark = pytest.mark.integration

LETTERS = 12
_TALLY = re.compile(r"replayed (\d+), failed (\d+), skipped (\d+), remaining (\d+)")


def _rows(dsn: str, sql: str) -> list[sa.Row[tuple[object, ...]]]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        found = list(conn.execute(sa.text(sql)).all())
    engine.dispose()
    return found


def _handled_by(found: list[Step], pid: int) -> tuple[float, float]:
    """When the walk of process ``pid`` started its first handler and ended its last."""
    mine = [s.at for s in found if s.pid == pid and s.what in ("start", "end")]
    return min(mine), max(mine)


def test_two_replay_walks_started_at_once_replay_each_letter_once_between_them(pg_dsn: str, tmp_path: Path) -> None:
    ids = [dead_letter(pg_dsn, {"n": n, "hold": 0.4}) for n in range(LETTERS)]
    log = tmp_path / "replays.log"
    walks = [subprocess.Popen(
        [sys.executable, "-m", "kstore", "dead-letters", "replay", "replay_processors:SlowReplay", "--group",
         SlowReplay.group, "--execute", "--reason", f"walk {n}", "--dsn", pg_dsn],
        cwd=SUPPORT_DIR, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": SUBPROCESS_PATH, LOG_ENV: str(log)}) for n in (1, 2)]
    said = [walk.communicate(timeout=120) for walk in walks]
    assert [walk.returncode for walk in walks] == [0, 0], said
    tallies = [_TALLY.match(out) for out, _ in said]
    assert all(tallies), said
    done = [int(t.group(1)) for t in tallies if t]
    assert sum(done) == LETTERS and all(int(t.group(2)) == 0 for t in tallies if t), said

    effects = Counter(int(r.value) for r in _rows(pg_dsn, "SELECT value FROM effects"))
    assert effects == {n: 1 for n in range(LETTERS)}, "every letter's effect once"
    history = _rows(pg_dsn, "SELECT dead_letter_id, to_status, reason FROM kstore_dead_letter_history")
    assert sorted(h.dead_letter_id for h in history) == ids and {h.to_status for h in history} == {"replayed"}
    assert Counter(h.reason for h in history) == {f"walk {n}": d for n, d in zip((1, 2), done, strict=True) if d}
    found = steps(log)
    pids = {s.pid for s in found if s.what == "start"}
    assert len(pids) == 2, "both walks replayed letters"
    (start_1, end_1), (start_2, end_2) = (_handled_by(found, pid) for pid in pids)
    assert start_1 < end_2 and start_2 < end_1, "the two walks' handlers ran at the same time"
