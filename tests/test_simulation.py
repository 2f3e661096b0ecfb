"""A deterministic simulation of the engine: thousands of random schedules of real
workers against a simulated Kafka group and a faulty SQLite database (see tests/sim).

Environment (all optional):

- ``KSTORE_SIM_SCHEDULES`` (default 2000) and ``KSTORE_SIM_FIRST`` (default 0): which seeds.
- ``KSTORE_SIM_JOBS``: processes to run them in (default: 2, or 1 on a one-core machine).
- ``KSTORE_SIM_SKIP``: comma-separated parts of the simulation to leave out (default
  :data:`KNOWN_BUGS`; ``KSTORE_SIM_SKIP=`` runs everything): the fault kinds
  ``lost_answer`` (a COMMIT lands, its answer is lost), ``fail_commit``,
  ``fail_statement``, ``down`` (the database refuses everything for a while);
  ``throttle`` (a tiny ``max_buffered_bytes``), ``steady`` (the livelock check: poison
  must be dead-lettered while other partitions keep receiving messages), ``crash``
  (skipped: a worker that raises just dies, its session times out, and the schedule goes on).
- ``KSTORE_SIM_SEED`` (and optionally ``KSTORE_SIM_ACTIONS``, a JSON action list from
  a shrunk report): replay one schedule and print its trace.
- ``KSTORE_SIM_SHRINK`` (default 200): runs spent shrinking each distinct failure.

By hand, for example: ``KSTORE_SIM_SCHEDULES=100000 KSTORE_SIM_FIRST=10000
.venv/bin/python -m pytest tests/test_simulation.py -q``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from .sim.runner import default_jobs, explain, parse_skip, replay_command, run_many
from .sim.schedule import run

#: Parts of the simulation left out by default because the committed engine still fails
#: them: each name is a reported bug; remove it once the fix is in. Empty today: what the
#: simulation found at cc9ff97 (effects twice after a COMMIT whose answer was lost; seek,
#: pause and resume raising for partitions revoked on kafka-python's IO thread; poison
#: never isolated beside another partition's backlog; every partition paused for good after
#: a flush while throttled; pending partitions forgotten mid-rebalance) is fixed since.
KNOWN_BUGS: frozenset[str] = frozenset({"late_read_back"})

SCHEDULES = int(os.environ.get("KSTORE_SIM_SCHEDULES", "2000"))


def _skip() -> frozenset[str]:
    return parse_skip(os.environ.get("KSTORE_SIM_SKIP"), KNOWN_BUGS)


@pytest.mark.timeout(max(600, SCHEDULES // 5))
def test_simulated_schedules_keep_every_invariant(tmp_path: Path) -> None:
    if os.environ.get("KSTORE_SIM_SEED"):
        pytest.skip("replaying one seed (KSTORE_SIM_SEED): see test_replay")
    first = int(os.environ.get("KSTORE_SIM_FIRST", "0"))
    jobs = int(os.environ.get("KSTORE_SIM_JOBS", str(default_jobs())))
    summary = run_many(first, SCHEDULES, tmp_path, _skip(), jobs)
    print(f"{summary.schedules} schedules in {summary.seconds:.1f}s ({summary.rate:.0f}/s, {jobs} job(s)), "
          f"{summary.delivered} messages delivered; left out: {', '.join(sorted(_skip())) or 'nothing'}")
    if summary.failures:
        pytest.fail(explain(summary, tmp_path, int(os.environ.get("KSTORE_SIM_SHRINK", "200"))), pytrace=False)


def _replay(tmp_path: Path) -> None:
    """``KSTORE_SIM_SEED=n``: run that one schedule (``KSTORE_SIM_ACTIONS``: with these actions) and show it."""
    raw = os.environ["KSTORE_SIM_SEED"]
    actions = os.environ.get("KSTORE_SIM_ACTIONS")
    outcome = run(int(raw), tmp_path, _skip(), [tuple(a) for a in json.loads(actions)] if actions else None)
    print(outcome.report(tail=10_000))
    if outcome.violation is not None:
        pytest.fail(f"{outcome.violation}\nreplay: {replay_command(outcome, outcome.actions)}", pytrace=False)


# A tool rather than a check: collected only when a seed is given, so a normal run has no skip.
if os.environ.get("KSTORE_SIM_SEED"):
    test_replay = _replay


def test_a_schedule_replays_identically(tmp_path: Path) -> None:
    """The same seed gives the same run: the same turns and the same commits."""
    skip = frozenset({"lost_answer", "crash"})
    first, again = run(7, tmp_path, skip), run(7, tmp_path, skip)
    assert _without_ids(first.trace) == _without_ids(again.trace)
    assert first.history == again.history


def _without_ids(trace: list[str]) -> list[str]:
    """Worker ids end in a random uuid: the only thing that differs between two runs."""
    return [re.sub(r"[^ ]+:[0-9]+:[0-9a-f]{8}", "ID", line) for line in trace]
