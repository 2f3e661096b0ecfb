"""The console benchmark (``python -m benchmarks.console``) still runs end to end, at a tiny size.

Not a performance test: the page times are not judged (the exit code says whether the targets
were met, and at this size they are), only that every group's overview was served with every
partition lagging, and that one round of sampling sent the database two statements.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from tests.support.harness import REPO_DIR

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_console_benchmark_serves_every_groups_overview_and_counts_the_samplers_statements(
        kafka: str, postgresql: Any) -> None:
    info = postgresql.info
    dsn = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.console", "--groups", "3", "--partitions", "4", "--letters", "3000",
         "--loads", "3", "--bootstrap-servers", kafka, "--dsn", dsn],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=220, check=False,
    )

    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert "3 groups of 4 partitions, 3,000 dead letters: prepared" in done.stdout
    overviews = re.findall(r"overview of console-\w+-(\d): first \d+ ms, then p50 \d+ ms, p90 \d+ ms", done.stdout)
    assert overviews == ["0", "1", "2"], done.stdout
    assert "one round of sampling (3 groups) sent 2 statements to the database (target < 3: met)" in done.stdout
