"""Two ``scripts/test`` sessions, and another project's pytest session, run at once on one machine:
the setups take turns at the virtualenv, and no session cuts another's PostgreSQL off its data
directory (pytest resets its own temp root, ``/tmp/pytest-of-<user>``, to mode 0700 whenever a session
without ``--basetemp`` makes its base temp; the tests' servers run as ``postgres``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import REPO_DIR, SUPPORT_DIR, wait_until

pytestmark = pytest.mark.integration

FOREIGN_TEST = '''
import os
import time
from pathlib import Path

def test_a_base_temp_of_its_own(tmp_path):
    probe = Path(os.environ["KSTORE_PROBE_DIR"])
    (probe / "foreign.up").touch()
    deadline = time.monotonic() + 300
    while not all((probe / f"{n}.checked").exists() for n in ("first", "second")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (probe / "foreign.checked").touch()
'''


def _session(name: str, others: str, probe: Path, cmd: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KSTORE_PROBE"))}
    env.update(KSTORE_PROBE_DIR=str(probe), KSTORE_PROBE_NAME=name, KSTORE_PROBE_OTHERS=others)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(600)
def test_two_test_sessions_and_a_foreign_one_started_together_all_pass(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    foreign = tmp_path / "other-project"
    foreign.mkdir()
    (foreign / "test_other.py").write_text(FOREIGN_TEST)
    # No --basetemp: each session makes its own, as anyone running pytest does.
    kstore_session = [str(REPO_DIR / "scripts" / "test"), "--pytest-only", "-p", "no:cacheprovider", "-p", "no:xdist",
                      "-q", str(SUPPORT_DIR / "session_probe.py")]
    foreign_session = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_other.py"]
    first = _session("first", "second,foreign", probe, kstore_session, REPO_DIR)
    second = _session("second", "first,foreign", probe, kstore_session, REPO_DIR)
    sessions = [first, second]
    try:
        # Another project's session starts once a kstore server is running, as in a second terminal.
        wait_until(lambda: any((probe / f"{n}.up").exists() for n in ("first", "second"))
                   or any(p.poll() is not None for p in sessions), timeout=300, what="a kstore session's server")
        sessions.append(_session("foreign", "", probe, foreign_session, foreign))
        names = ("first", "second", "foreign")
        outputs = {n: p.communicate(timeout=500)[0] for n, p in zip(names, sessions, strict=True)}
        codes = {n: p.returncode for n, p in zip(names, sessions, strict=True)}
    finally:
        for p in sessions:
            if p.poll() is None:
                p.kill()
    assert codes == {"first": 0, "second": 0, "foreign": 0}, "\n".join(
        f"--- {name}\n{out[-3000:]}" for name, out in outputs.items())
