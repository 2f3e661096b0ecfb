"""Running one contender's child process and measuring it from outside.

CPU time comes from ``os.wait4`` on that very child. Peak RSS comes from the
child's own ``VmHWM`` (/proc/self/status, read when it is done): ``wait4``'s
``ru_maxrss`` cannot be used, because it counts the memory the child shared
with this (much larger) parent between fork and exec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .profiling import start_profiler

REPO = Path(__file__).resolve().parent.parent


class BenchmarkError(RuntimeError):
    """A contender failed, timed out or broke the exactly-once check: the run fails."""


@dataclass
class Outcome:
    result: dict[str, Any]
    peak_rss_mb: float
    cpu_s: float


class Child:
    """``python -m benchmarks.child`` with ``config`` on its stdin and its output in ``log_path``."""

    def __init__(self, config: dict[str, Any], log_path: Path, profile_path: Path | None = None,
                 gil: bool = False) -> None:
        self.name = f"{config['contender']} ({config['phase']})"
        self.log_path = log_path
        self.result_path = Path(config["result_file"])
        self.result_path.unlink(missing_ok=True)
        paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.child"],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config).encode())
        self.proc.stdin.close()
        self.profiler = start_profiler(self.proc.pid, profile_path, gil) if profile_path else None

    def wait_ready(self, ready_file: Path, timeout: float) -> None:
        """Until the contender holds its partitions (it touches ``ready_file``)."""
        deadline = time.monotonic() + timeout
        while not ready_file.exists():
            if not self._alive():
                raise BenchmarkError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise BenchmarkError(f"{self.name} was not assigned its partitions within {timeout:.0f} s:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> Outcome:
        """Until the child exits; its measurements plus the kernel's peak RSS and CPU time for it."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                self.kill()
                raise BenchmarkError(f"{self.name} did not finish within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)
        # Tell Popen the child is reaped, so it never waits for it again.
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self._stop_profiler()
        if self.proc.returncode != 0 or not self.result_path.exists():
            raise BenchmarkError(f"{self.name} failed (exit {self.proc.returncode}):\n{self.log_tail()}")
        result = json.loads(self.result_path.read_text())
        return Outcome(result, (result.get("vmhwm_kb") or 0) / 1024, usage.ru_utime + usage.ru_stime)

    def kill(self) -> None:
        """Stop this child (only this one, by its pid) if it is still running."""
        if self.proc.returncode is None:
            self.proc.kill()
            self.proc.wait()
        self._stop_profiler()

    def _alive(self) -> bool:
        # Poll without reaping: wait4 in wait() must be the one that reaps, to get the rusage.
        if self.proc.returncode is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def _stop_profiler(self) -> None:
        # py-spy exits by itself when its target does; wait for it to write its file.
        if self.profiler is not None:
            try:
                self.profiler.wait(60)
            except subprocess.TimeoutExpired:
                self.profiler.kill()
                self.profiler.wait()
            self.profiler = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) + f"\n(full log: {self.log_path})"
