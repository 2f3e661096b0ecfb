"""The outbox benchmark (``python -m benchmarks.outbox``) still runs end to end: ``--tiny``.

Not a performance test: the numbers are not judged, only that every contender ran both
phases, every output record reached the reader once, and every effect row is there once.
Uses the test session's broker and this test's own PostgreSQL database.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.outbox.cli import TINY
from benchmarks.outbox.runner import CONTENDERS
from tests.support.harness import REPO_DIR

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_outbox_benchmark_runs_every_contender_exactly_once(kafka: str, postgresql: Any, tmp_path: Path) -> None:
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.outbox", "--tiny", "--bootstrap-servers", kafka, "--dsn", dsn,
         "--out", str(tmp_path)],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=220, check=False,
    )

    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    results = json.loads((tmp_path / "outbox.json").read_text())
    assert [c["name"] for c in results["contenders"]] == [c.name for c in CONTENDERS]
    steady_messages = round(TINY["rate"] * TINY["seconds"])
    for c in results["contenders"]:
        for phase, messages in (("throughput", TINY["messages"]), ("steady", steady_messages)):
            r = c[phase]
            check = r["exactly_once"]
            assert (check["effect_rows"], check["output_records"], check["duplicates"], check["missing"]) == (
                messages, messages, 0, 0), (c["name"], phase, check)
            assert r["visible_msgs_per_s"] > 0 and r["reader_repeats"] == 0, (c["name"], phase)
        lat = c["steady"]["latency"]
        assert lat["count"] > 0 and lat["p99_ms"] >= lat["p50_ms"] > 0, c["name"]
    assert [r["against"] for r in results["ratios"]] == [c.name for c in CONTENDERS[1:]]
    (target,) = results["target"]
    by_name = {c["name"]: c["steady"]["latency"] for c in results["contenders"]}
    assert target["p99"] == by_name["kstore-produce"]["p99_ms"] / by_name["send-after-commit"]["p99_ms"]
    assert (target["p50_target"], target["p99_target"]) == (2.0, 2.5)
    assert "of send-after-commit: " in done.stdout
    assert "kstore vs polled-outbox: throughput x" in done.stdout
