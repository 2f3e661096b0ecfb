"""What a contender's loop measures about itself, inside its child process.

Kept free of Kafka and database imports: every child loads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

#: The values carry their produce time as 19 leading ASCII digits (see workload.make_value).
STAMP_DIGITS = 19


class Meter:
    """Counts messages to the expected total and records when each one was done.

    Throughput is ``count / (last - first)``: from the first record in hand to
    the last one done (committed, or merely received for the raw loops), so
    start-up and the group join are not counted. In the latency phase each
    loop calls :meth:`stamp` when its messages are done; the latency of a
    message is that wall-clock time minus the produce time in its value.
    """

    def __init__(self, expected: int, latency: bool, run_cpu: Callable[[], float] | None = None) -> None:
        self.expected = expected
        self.latency = latency
        #: The whole run's CPU seconds so far (this process, the broker, the database; see
        #: noise.Noise.run_cpu_s), read as the clock starts and stops: what the drain cost the machine.
        self._run_cpu = run_cpu
        self._cpu_at_first = self._cpu_at_last = 0.0
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self._produced: list[int] = []
        self._done: list[int] = []
        #: Facts the contender reports alongside its numbers (e.g. the kstore settings used).
        self.extra: dict[str, Any] = {}
        #: Resident memory at each tenth of the messages: flat if memory is bounded by
        #: configuration, climbing if it grows with the backlog.
        self.rss_mb: list[float] = []

    def started(self) -> None:
        """A batch of records is in hand; the first call starts the clock."""
        if self.first is None:
            if self._run_cpu is not None:
                self._cpu_at_first = self._run_cpu()
            self.first = time.perf_counter()

    def counted(self, n: int) -> bool:
        """``n`` more messages were handled; True once all expected ones were."""
        self.count += n
        if self.count * 10 >= self.expected * (len(self.rss_mb) + 1):
            self.rss_mb.append(round(_status_kb("VmRSS") / 1024, 1))
        return self.count >= self.expected

    def finished(self) -> None:
        """The last message is done (committed): stop the clock."""
        if self.last is None:
            self.last = time.perf_counter()
            if self._run_cpu is not None:
                self._cpu_at_last = self._run_cpu()

    def stamp(self, values: Iterable[bytes]) -> None:
        """These messages are done now (latency phase only)."""
        self.stamp_ns(int(v[:STAMP_DIGITS]) for v in values)

    def stamp_ns(self, produced: Iterable[int]) -> None:
        """The messages produced at these times (``time.time_ns()``) are done now (latency phase only)."""
        now = time.time_ns()
        before = len(self._produced)
        self._produced.extend(produced)
        self._done.extend([now] * (len(self._produced) - before))

    def batch_done(self, rows: Sequence[tuple[Any, Any, bytes]], after: Callable[[], None] | None) -> bool:
        """A hand-written loop committed ``rows`` (``(partition, offset, value)``): stamp them (latency
        phase), run ``after`` (its Kafka commit, if any), count them; True once all are done."""
        if self.latency:
            self.stamp(row[2] for row in rows)
        if after is not None:
            after()
        if self.counted(len(rows)):
            self.finished()
            return True
        return False

    def result(self, warmup_s: float) -> dict[str, Any]:
        if self.first is None or self.last is None:
            raise RuntimeError(f"stopped after {self.count} of {self.expected} messages")
        seconds = max(self.last - self.first, 1e-9)
        out: dict[str, Any] = {"messages": self.count, "seconds": seconds, "throughput": self.count / seconds}
        if self.latency:
            out["latency"] = latency_stats(self._produced, self._done, int(warmup_s * 1e9))
        if self._run_cpu is not None:
            out["run_cpu_s"] = round(self._cpu_at_last - self._cpu_at_first, 3)
        out["vmhwm_kb"] = _status_kb("VmHWM")
        out["rss_mb_by_tenth"] = self.rss_mb
        return out | self.extra


def latency_stats(produced: list[int], done: list[int], warmup_ns: int) -> dict[str, Any]:
    """Percentiles (nearest rank) of done - produced, leaving out messages produced during the warm-up."""
    if not produced:
        raise RuntimeError("no message was stamped in the latency phase")
    cutoff = min(produced) + warmup_ns
    samples = sorted(d - p for p, d in zip(produced, done, strict=True) if p >= cutoff)
    if not samples:
        raise RuntimeError("every message of the latency phase fell in the warm-up: run it for longer")

    def pct(q: float) -> float:
        return samples[max(0, math.ceil(q * len(samples)) - 1)] / 1e6

    return {
        # From the first message produced to the last one done: with the message count,
        # the rate the contender actually sustained (see runner.kept_up).
        "span_s": (max(done) - min(produced)) / 1e9,
        "count": len(samples),
        "warmup_excluded": len(produced) - len(samples),
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": samples[-1] / 1e6,
        "mean_ms": sum(samples) / len(samples) / 1e6,
    }


def _status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmHWM: peak resident set), in KiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def signal_ready(path: str | None) -> None:
    """Tell the parent this contender holds its partitions (it then starts producing)."""
    if path:
        Path(path).touch()
