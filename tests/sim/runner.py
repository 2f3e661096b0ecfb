"""Running many schedules, in one process or a few, and what to print when some fail."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .db import adopt_template, template
from .schedule import OPTIONAL, Action, Outcome, run, shrink, signature


@dataclass
class Summary:
    """What a batch of schedules did: how many, how fast, and the first failure of each signature."""

    schedules: int = 0
    seconds: float = 0.0
    delivered: int = 0
    failures: dict[str, list[Outcome]] = field(default_factory=dict)
    #: Faults that went off, by kind, over all the schedules.
    fired: Counter[str] = field(default_factory=Counter)
    #: For each fault kind: how many schedules enabled it.
    enabled: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: Outcome) -> None:
        self.schedules += 1
        self.delivered += outcome.delivered
        self.fired.update(outcome.fired)
        self.enabled.update(outcome.config.faults)
        if outcome.violation is not None:
            runs = self.failures.setdefault(signature(outcome.violation), [])
            if not runs:
                runs.append(outcome)
            else:  # keep the report of the first one only
                runs.append(_slim(outcome))

    def merge(self, other: Summary) -> None:
        self.schedules += other.schedules
        self.delivered += other.delivered
        self.fired.update(other.fired)
        self.enabled.update(other.enabled)
        for sig, outcomes in other.failures.items():
            mine = self.failures.setdefault(sig, [])
            mine.extend(outcomes if not mine else [_slim(o) for o in outcomes])

    @property
    def rate(self) -> float:
        return self.schedules / self.seconds if self.seconds else 0.0


def _slim(outcome: Outcome) -> Outcome:
    outcome.trace, outcome.history, outcome.state = [], [], []
    return outcome


def _run_range(args: tuple[int, int, str, str, frozenset[str]]) -> Summary:
    first, count, directory, built, skip = args
    adopt_template(Path(directory), Path(built))
    summary = Summary()
    for seed in range(first, first + count):
        summary.add(run(seed, Path(directory), skip))
    return summary


def run_many(blocks: Sequence[tuple[int, int]], directory: Path, skip: frozenset[str], jobs: int = 1) -> Summary:
    """Run each block of seeds ``(first, count)``: ``first .. first + count - 1``, in ``jobs`` processes."""
    started = time.perf_counter()
    built = str(template(directory))  # once, before the processes start
    count = sum(n for _, n in blocks)
    jobs = max(1, min(jobs, count))
    chunks = [(*chunk, str(directory), built, skip) for first, n in blocks
              for chunk in _chunks(first, n, jobs * 4 if jobs > 1 else 1)]
    summary = Summary()
    if jobs == 1:
        for chunk in chunks:
            summary.merge(_run_range(chunk))
    else:
        # Not fork: under pytest the process may have threads (Kafka clients of other tests)
        # whose locks a forked child would inherit held.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            for part in pool.map(_run_range, chunks):
                summary.merge(part)
    summary.seconds = time.perf_counter() - started
    return summary


def _chunks(first: int, count: int, n: int) -> list[tuple[int, int]]:
    size, extra = divmod(count, n)
    out, start = [], first
    for i in range(n):
        length = size + (1 if i < extra else 0)
        if length:
            out.append((start, length))
        start += length
    return out


def parse_skip(raw: str | None, default: Iterable[str]) -> frozenset[str]:
    """``KSTORE_SIM_SKIP``: a comma-separated subset of :data:`~.schedule.OPTIONAL` ("" for nothing)."""
    names = frozenset(default) if raw is None else frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = names - set(OPTIONAL)
    if unknown:
        raise ValueError(f"unknown KSTORE_SIM_SKIP entries {sorted(unknown)}; known: {', '.join(OPTIONAL)}")
    return names


def replay_command(outcome: Outcome, actions: list[Action] | None = None) -> str:
    env = ["KSTORE_SIM_BY_HAND=1", f"KSTORE_SIM_SEED={outcome.seed}",
           f"KSTORE_SIM_SKIP={','.join(sorted(outcome.config.skip))}"]
    if actions is not None:
        env.append(f"KSTORE_SIM_ACTIONS='{json.dumps(actions)}'")
    return " ".join(env) + " .venv/bin/python -m pytest tests/sim/test_simulation.py -q"


def explain(summary: Summary, directory: Path, shrink_budget: int) -> str:
    """A report of each distinct violation: how often, its first seed shrunk to a short schedule, how to replay."""
    parts = [f"{sum(len(v) for v in summary.failures.values())} of {summary.schedules} schedules violated "
             f"an invariant ({len(summary.failures)} distinct):"]
    for sig, outcomes in summary.failures.items():
        first = outcomes[0]
        small = shrink(first, directory, shrink_budget) if shrink_budget else first
        parts += ["", f"=== {sig}", f"{len(outcomes)} schedule(s), seeds {[o.seed for o in outcomes[:12]]}",
                  f"replay the first:  {replay_command(first)}",
                  f"replay it shrunk:  {replay_command(small, small.actions)}", small.report(tail=250)]
    return "\n".join(parts)


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))
