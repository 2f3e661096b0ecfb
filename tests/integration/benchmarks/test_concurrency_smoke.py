"""The concurrency benchmark (``python -m benchmarks.concurrency``) still runs end to end: ``--tiny``.

The figures are not judged against targets here (a shared CI machine), only that every run was
exactly once, and, as a ratio, that the async handler beat the sequential one where keys allow it.
Uses the test session's broker and this test's own PostgreSQL database.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import REPO_DIR

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_concurrency_benchmark_runs_exactly_once_and_async_beats_sequential(
        kafka: str, postgresql: Any, tmp_path: Path) -> None:
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.concurrency", "--tiny", "--bootstrap-servers", kafka, "--dsn", dsn,
         "--out", str(tmp_path)],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=110, check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    results = json.loads((tmp_path / "concurrency.json").read_text())
    assert sorted((r["contender"], r["keys"]) for r in results["runs"]) == [
        ("async", 10), ("async", 10_000), ("sequential", 10), ("sequential", 10_000)]
    assert all(r["exactly_once"] and r["rows"] == 1000 for r in results["runs"])
    speedup = {r["keys"]: r["speedup"] for r in results["ratios"]}
    # 1,000 messages of ~2.5 ms each: with 10,000 keys, 64 at a time; with 10, ten lanes.
    assert speedup[10_000] > 4 and speedup[10] > 2, speedup
