"""``scripts/test``: the checks and pytest by default (CI's way), pytest alone when asked."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.harness import REPO_DIR

#: One quick test that needs no service, run by the nested pytest.
ONE_TEST = "tests/unit/test_settings.py::test_safe_dsn_masks_the_password"


def scripts_test(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "KSTORE_TEST_CHECKS"}
    return subprocess.run(["scripts/test", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=600,
                          env={**clean, **(env or {})})


@pytest.mark.parametrize(("args", "env"), [
    (["--pytest-only"], {}),
    ([], {"KSTORE_TEST_CHECKS": "0"}),
])
def test_pytest_alone_when_asked(args: list[str], env: dict[str, str]) -> None:
    r = scripts_test(*args, "-p", "no:cacheprovider", "-q", ONE_TEST, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "test: pytest only" in r.stdout and "1 passed" in r.stdout, r.stdout[-3000:]
    assert "test: ruff" not in r.stdout and "test: docs" not in r.stdout


def test_a_checks_switch_that_is_neither_0_nor_1_is_refused() -> None:
    r = scripts_test(ONE_TEST, env={"KSTORE_TEST_CHECKS": "no"})
    assert r.returncode == 2 and r.stderr.strip() == "test: KSTORE_TEST_CHECKS must be 0 or 1, got 'no'", r.stderr


def test_setup_is_skipped_only_when_asked() -> None:
    """KSTORE_TEST_SETUP=0 (.ci/run's first pass, which set up before starting the release check beside
    it) runs no scripts/setup; any value but 0 or 1 is refused before anything runs."""
    r = scripts_test("--pytest-only", "-p", "no:cacheprovider", "-q", ONE_TEST, env={"KSTORE_TEST_SETUP": "0"})
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "test: no scripts/setup (KSTORE_TEST_SETUP=0)" in r.stdout and "setup: " not in r.stdout, r.stdout
    r = scripts_test(ONE_TEST, env={"KSTORE_TEST_SETUP": "no"})
    assert r.returncode == 2 and r.stderr.strip() == "test: KSTORE_TEST_SETUP must be 0 or 1, got 'no'", r.stderr


def test_ci_runs_every_check() -> None:
    """.ci/run's first pass asks for the checks itself, whatever the environment it inherits says;
    the passes after it (other drivers, the other Kafka client) run pytest alone."""
    runs = [line for line in (REPO_DIR / ".ci" / "run").read_text().splitlines() if "scripts/test" in line
            and not line.lstrip().startswith("#")]
    assert runs and "KSTORE_TEST_CHECKS=1 " in runs[0] and "--pytest-only" not in runs[0], runs
    assert all("KSTORE_TEST_CHECKS=0 " in line for line in runs[1:]), runs
