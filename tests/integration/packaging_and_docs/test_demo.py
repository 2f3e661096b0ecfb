"""The demo (examples/demo.py, what ``scripts/demo`` runs) needs confluent-kafka alone: its local broker,
its topics, its records and its read_committed reader work where kafka-python is not installed, in the
demo's process and in the workers it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.harness import REPO_DIR, without_kafka_python


def test_the_demo_runs_without_kafka_python(tmp_path: Path) -> None:
    """Both pipelines, one after the other: the demo keeps its files in one folder of the checkout."""
    # The defaults, as a new user meets them: none of the tests' KSTORE_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([without_kafka_python(tmp_path), os.environ.get("PYTHONPATH", "")])
    for pipeline, done in [("pageviews", "demo: every view counted exactly once"),
                           ("payments", "demo: every payment booked once and announced exactly once")]:
        r = subprocess.run([sys.executable, str(REPO_DIR / "examples" / "demo.py"), "--pipeline", pipeline,
                            "--events", "2000", "--no-crash"], capture_output=True, text=True, timeout=300,
                           env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert done in r.stdout, r.stdout
        assert "stopped the local broker" in r.stdout, r.stdout
