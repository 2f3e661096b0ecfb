"""The application outbox benchmark (``python -m benchmarks.app_outbox``) still runs end to end: ``--tiny``.

Not a performance test: the numbers are not judged, only that both contenders ran every phase,
every committed order's record was read, and kstore's exactly once (the by-hand loop, at most
once, loses nothing without a crash either). Uses the test session's broker and this test's own
PostgreSQL database.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.app_outbox.cli import TINY
from benchmarks.app_outbox.runner import CONTENDERS
from tests.support.harness import REPO_DIR

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_app_outbox_benchmark_runs_both_contenders_exactly_once(kafka: str, postgresql: Any, tmp_path: Path) -> None:
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    out = tmp_path / "app_outbox.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.app_outbox", "--tiny", "--bootstrap-servers", kafka, "--dsn", dsn,
         "--out", str(out)],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=110, check=False,
    )

    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    results = json.loads(out.read_text())
    paced = round(float(TINY["rate"]) * TINY["seconds"])
    assert [(p["name"], p["rate"]) for p in results["phases"]] == [("flat-out", None), ("200/s", 200.0)]
    for phase, requests in zip(results["phases"], (TINY["requests"], paced), strict=True):
        assert [r["name"] for r in phase["contenders"]] == [c.name for c in CONTENDERS]
        for r in phase["contenders"]:
            # Paced, a contender that fell behind stops at the phase's end with fewer: not judged here.
            committed, once = r["committed"], r["exactly_once"]
            assert 0 < committed <= requests and (phase["rate"] or committed == requests), (phase["name"], r)
            assert (once["orders"], once["records"], once["lost"], once["duplicates"]) == (
                committed, committed, 0, 0), (phase["name"], r["name"], once)
            assert once["passed"] and r["readable"] == committed and r["reader_repeats"] == 0, (phase["name"], r)
            assert r["latency"]["count"] > 0 and r["latency"]["p99_ms"] >= r["latency"]["p50_ms"] > 0
        kstore = phase["contenders"][0]
        assert kstore["relay"]["records"] == kstore["committed"], kstore["relay"]
    assert {t["what"] for t in results["targets"]} == {"throughput", "p50", "p99"}
    assert "kstore / by hand: throughput x" in done.stdout
