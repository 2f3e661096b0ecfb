"""How much CPU other processes took during a phase: the benchmark's noise floor.

On a 2-core machine a test suite or a build running beside the benchmark
changes every number. Each phase records the machine's busy CPU time (from
/proc/stat) minus what the run itself used (the benchmark process and its
descendants, including reaped ones, and the throwaway PostgreSQL), so a
disturbed result says so instead of passing for a real one. A broker or
database given with ``--bootstrap-servers``/``--dsn`` on this machine counts as
"other" too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Other processes using more than this share of one core during a phase are worth a warning.
WARN_CORES = 0.10


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def _processes() -> dict[int, tuple[int, float]]:
    """``{pid: (ppid, CPU seconds incl. reaped children)}`` for every process now."""
    out: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # Fields after the command name (which may hold spaces and parentheses).
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        out[int(entry.name)] = (int(fields[1]), ticks / CLK_TCK)
    return out


def _descendants(procs: dict[int, tuple[int, float]], roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _cpu) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


class Noise:
    """CPU seconds used by other processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, roots: list[int], parent: int | None = None) -> None:
        """``roots``: the run's processes that are not descendants of the benchmark's own process
        (a PostgreSQL started through pg_ctl); ``parent``: the benchmark's process, if not this one."""
        self.roots = {parent or os.getpid(), *roots}
        self._busy = 0.0
        self._ours: dict[int, float] = {}
        self._started = 0.0

    def _our_cpu(self) -> dict[int, float]:
        procs = _processes()
        return {pid: procs[pid][1] for pid in _descendants(procs, self.roots) if pid in procs}

    def start(self) -> None:
        self._ours = self._our_cpu()
        self._busy = _machine_busy_s()
        self._started = time.monotonic()

    def stop(self) -> dict[str, float]:
        busy = _machine_busy_s() - self._busy
        seconds = max(time.monotonic() - self._started, 1e-9)
        now = self._our_cpu()
        # A child that exited meanwhile was reaped by one of ours: its CPU is in that
        # parent's reaped-children time, so it is counted once here.
        ours = sum(cpu - self._ours.get(pid, 0.0) for pid, cpu in now.items())
        other = max(0.0, busy - ours)
        return {"other_cpu_s": round(other, 2), "other_cores": round(other / seconds, 3),
                "machine_busy_cores": round(busy / seconds, 3)}

    def run_cpu_s(self) -> float:
        """CPU seconds the run's processes (see :meth:`__init__`'s roots) have used so far; about 1 ms
        to read. A contender's child reads it as its drain starts and ends (see Meter)."""
        return sum(self._our_cpu().values())

    def wait_quiet(self, timeout: float, window: float = 2.0) -> float:
        """Until other processes use at most ``WARN_CORES`` over ``window`` seconds, or ``timeout``
        passed; returns the seconds waited. The run's own services idle meanwhile."""
        started = time.monotonic()
        while True:
            self.start()
            time.sleep(window)
            if self.stop()["other_cores"] <= WARN_CORES or time.monotonic() - started >= timeout:
                return time.monotonic() - started
