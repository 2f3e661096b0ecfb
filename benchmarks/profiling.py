"""``--profile``: sample each contender's children with py-spy and summarise where their time went.

py-spy samples from outside the process, every thread (kafka-python does part
of its work on its IO thread), without instrumenting the code, so the profile
shows the same program the numbers come from, only a little slower.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 250


def py_spy() -> str:
    """The py-spy executable (next to this Python first: it is pip-installed into the venv)."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("--profile needs py-spy: pip install py-spy")
    return found


def start_profiler(pid: int, path: Path, gil: bool = False) -> subprocess.Popen[bytes]:
    """Record ``pid`` until it exits, as collapsed stacks (one ``frame;frame;... count`` per line).

    ``gil``: sample only the thread holding the GIL. All of a worker's threads share
    one interpreter lock, so this shows what its Python time is spent on, by thread,
    without the waiting threads that the idle heuristic counts as busy.
    """
    cmd = [py_spy(), "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw",
           "--threads", "--nonblocking", "--output", str(path), *(["--gil"] if gil else [])]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


REPO = str(Path(__file__).resolve().parent.parent) + "/"
#: Frames every sample passes through: they say nothing about where the time went.
WRAPPERS = ("<frozen runpy>", "benchmarks/child.py")


def _function(frame: str) -> str:
    """``handle_batch (kstore/engine/worker.py:123)`` -> ``handle_batch (kstore/engine/worker.py)``."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rstrip(")")
    for marker in ("site-packages/", REPO, "lib/python3.11/", "lib/python3.12/", "lib/python3.10/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{name} ({file})" if file else name


def _read(path: Path) -> tuple[Counter[str], Counter[str], int, int]:
    """Self and total samples per function, samples counted, and samples spent importing."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = importing = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_function(f) for f in stack.split(";") if not f.startswith("thread (")]
        if not frames:
            continue
        if any(f.startswith("_find_and_load ") for f in frames):
            importing += int(count)  # start-up, not the loop being measured
            continue
        samples += int(count)
        own[frames[-1]] += int(count)
        for name in set(frames):
            if not any(w in name for w in WRAPPERS):
                total[name] += int(count)
    return own, total, samples, importing


def summarize(path: Path, top: int = 25, gil: bool = False) -> str:
    """The functions with the most samples: self (the frame running) and total (anywhere on the stack)."""
    own, total, samples, importing = _read(path)
    if not samples:
        return "no samples"
    which = "the thread holding the GIL" if gil else "all threads, idle excluded"
    lines = [
        f"{samples} samples at {RATE_HZ} Hz ({which}; "
        f"{importing} more samples of start-up imports left out)",
        "", "self %   function",
    ]
    lines += [f"{100 * n / samples:6.1f}   {name}" for name, n in own.most_common(top)]
    lines += ["", "total %  function"]
    lines += [f"{100 * n / samples:6.1f}   {name}" for name, n in total.most_common(top)]
    return "\n".join(lines)
