"""Schedules: drawn from a seed, run against a fresh world, shrunk when they fail.

A schedule is a :class:`~.world.Config` and a list of actions, both drawn from the
seed; the world's own choices (fetch sizes, preemption points, the assignor's order)
come from a second generator seeded from the same seed. So a seed (with the same
``KSTORE_SIM_SKIP``) replays exactly, and a shrunk action list replays with the seed
it came from. (The stub cluster hands kstore partitions in sorted lists, so
``PYTHONHASHSEED`` does not matter as far as we have seen.)
"""

from __future__ import annotations

import gc
import json
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import kstore.db.deadletters
import kstore.db.store
import kstore.engine.worker

from .clock import patched_time
from .db import template
from .invariants import Violation
from .world import FAULT_KINDS, Config, World

Action = tuple[Any, ...]

#: (weight, kind) of the actions a schedule draws from.
_WEIGHTS: list[tuple[float, str]] = [
    (20, "fetch"), (28, "step"), (8, "produce"), (5, "tick"), (1, "long_tick"),
    (2, "join"), (1, "leave"), (1, "restart"), (0.7, "kill"), (1.2, "pause"), (1.5, "expire"), (1.5, "unpause"),
    (1.5, "operator_reset"), (1, "worker_reset"), (4, "arm"), (0.7, "down"), (1, "up"),
]


#: What a run may leave out: fault kinds, and parts of the world that a known bug breaks
#: (see tests/sim/test_simulation.py). "crash": a worker that raises dies (its session times
#: out) instead of failing the schedule. "late_read_back": a batch re-delivered under its
#: epoch below the stored offset, by a worker one of whose COMMITs landed after its answer
#: was lost, is let through (it cannot commit: the journal still checks that it does not).
TOLERABLE = ("crash", "late_read_back")
#: "confluent": every worker's consumer has kafka-python's threading (see world.CLIENTS).
OPTIONAL = (*FAULT_KINDS, "throttle", "steady", "confluent", *TOLERABLE)


def draw_config(rng: random.Random, skip: frozenset[str], client_rng: random.Random | None = None) -> Config:
    """The world's shape. Draws the same numbers whatever ``skip`` is: a seed keeps its shape.

    The client's threading is drawn from ``client_rng`` (seeded from the seed too): a seed's other
    draws, and so its actions, are what they were before the client was drawn."""
    n = rng.randint(2, 4)
    partitions = {"t": n} if rng.random() < 0.8 else {"t": n - 1, "u": 1}
    slots = rng.choice([2, 2, 3])
    batch = rng.choice([1, 2, 3, 5, 8])
    buffered = rng.choice([32 * 2**20, 32 * 2**20, 700])
    return Config(
        partitions=partitions,
        slots=slots,
        max_batch_size=batch,
        max_poll_records=rng.choice([1, 2, 4, 8]),
        # 700 bytes: fetching pauses (throttles) after about three records.
        max_buffered_bytes=32 * 2**20 if "throttle" in skip else buffered,
        preempt=rng.choice([0.0, 0.0, 0.1, 0.3]),
        resets=rng.random() < 0.6,
        faults=frozenset(k for k in FAULT_KINDS if rng.random() < 0.6 and k not in skip),
        tolerate=frozenset(TOLERABLE) & skip,
        steady="steady" not in skip,
        skip=skip,
        client="confluent" if client_rng is not None and client_rng.random() < 0.5 and "confluent" not in skip
        else "kafka-python",
    )


def draw_actions(rng: random.Random, cfg: Config) -> list[Action]:
    tps = [(t, p) for t, n in sorted(cfg.partitions.items()) for p in range(n)]
    actions: list[Action] = [("join", 0)]
    if rng.random() < 0.6:
        actions.append(("join", 1))
    for _ in range(rng.randint(2, 5)):
        actions.append(("produce", rng.randrange(len(tps)), rng.randint(1, 6), rng.random() < 0.15))
    weights = [(w, k) for w, k in _WEIGHTS if _enabled(k, cfg)]
    for _ in range(rng.randint(25, 70)):
        kind = rng.choices([k for _, k in weights], [w for w, _ in weights])[0]
        actions.append(_draw(rng, kind, cfg, len(tps)))
    return actions


def _enabled(kind: str, cfg: Config) -> bool:
    if kind in ("operator_reset", "worker_reset"):
        return cfg.resets
    if kind == "arm":
        return bool(cfg.faults - {"down"})
    if kind in ("down", "up"):
        return "down" in cfg.faults
    return True


def _draw(rng: random.Random, kind: str, cfg: Config, n_tps: int) -> Action:
    slot = rng.randrange(cfg.slots)
    if kind == "produce":
        return (kind, rng.randrange(n_tps), rng.randint(1, 4), rng.random() < 0.1)
    if kind in ("tick", "long_tick"):
        return (kind, round(rng.uniform(0.05, 0.6) if kind == "tick" else rng.uniform(1.0, 12.0), 3))
    if kind == "operator_reset":
        return (kind, rng.randrange(n_tps), round(rng.random(), 2))
    if kind == "worker_reset":
        return (kind, slot, rng.randrange(4), round(rng.random(), 2), rng.random() < 0.5)
    if kind == "arm":
        return (kind, slot, rng.choice(sorted(cfg.faults - {"down"})))
    if kind in ("down", "up"):
        return (kind,)
    return (kind, slot)


def apply(world: World, action: Action) -> None:
    """Run one action and check the invariants after it."""
    kind, *args = action
    tps = world.cluster.partitions
    handlers: dict[str, Callable[[], Any]] = {
        "fetch": lambda: world.fetch(args[0]),
        "step": lambda: world.step(args[0]),
        "produce": lambda: world.produce(tps[args[0] % len(tps)], args[1], args[2]),
        "tick": lambda: world.clock.advance(args[0]),
        "long_tick": lambda: world.clock.advance(args[0]),
        "join": lambda: world.slots[args[0]] is None and world.spawn(args[0]),
        "leave": lambda: world.leave(args[0]),
        "restart": lambda: world.restart(args[0]),
        "kill": lambda: world.kill(args[0]),
        "pause": lambda: world.pause(args[0]),
        "expire": lambda: world.expire(args[0]),
        "unpause": lambda: world.unpause(args[0]),
        "operator_reset": lambda: world.operator_reset(tps[args[0] % len(tps)], args[1]),
        "worker_reset": lambda: world.worker_reset(args[0], args[1], args[2], bool(args[3:4] and args[3])),
        "arm": lambda: world.arm(args[0], args[1]),
        "down": lambda: world.set_down(True),
        "up": lambda: world.set_down(False),
    }
    world.act(" ".join(map(str, action)), handlers[kind])


@dataclass
class Outcome:
    seed: int
    config: Config
    actions: list[Action]
    violation: Violation | None
    trace: list[str]
    state: list[str]
    history: list[str]
    crashes: list[str]
    delivered: int
    seconds: float
    #: Faults that went off, by kind (see :attr:`.db.Databases.fired`).
    fired: Counter[str]

    def report(self, tail: int = 60) -> str:
        lines = [f"seed {self.seed}: {self.violation}", f"config: {self.config}",
                 f"actions ({len(self.actions)}): {json.dumps(self.actions)}",
                 f"last {tail} turns:", *("  " + t for t in self.trace[-tail:]),
                 "last committed transactions:", *("  " + h for h in self.history[-15:]),
                 "state at the end:", *("  " + line for line in self.state),
                 f"faults fired: {dict(sorted(self.fired.items())) or 'none'}",
                 *(f"crash (tolerated): {c}" for c in self.crashes)]
        return "\n".join(lines)


@contextmanager
def patched_kstore(world: World) -> Iterator[None]:
    """kstore's engine gets the world's faulty connections, its clock the world's, its log
    lines go into the trace; the migration check is skipped (the template was migrated once)."""
    swaps = [(kstore.engine.worker, "make_engine", world.db.make_engine),
             (kstore.engine.worker, "check_migrated", lambda *_args: None),
             *_shared_tables()]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, value in swaps:
        setattr(module, name, value)
    try:
        with patched_time(world.clock), _logs_into(world.trace):
            yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@contextmanager
def _no_collector() -> Iterator[None]:
    """No garbage collection during a schedule: an object collected at some moment (a pooled
    connection of an earlier turn going back to its pool) would make the run depend on
    when the collector happened to run, not on the seed alone."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def _logs_into(trace: list[str]) -> Iterator[None]:
    logger = logging.getLogger("kstore")
    handler = _TraceHandler(trace)
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


_tables: dict[tuple[str, str, str | None], Any] = {}


def _shared_tables() -> list[tuple[ModuleType, str, Callable[..., Any]]]:
    """kstore's table builders, memoized per (prefix, schema) instead of new Tables per Store.

    SQLAlchemy caches compiled statements by their tables' identity: with new Table
    objects for each worker, every schedule compiled every statement again (a fifth of
    the run time). The tables are the same either way.
    """
    swaps: list[tuple[ModuleType, str, Callable[..., Any]]] = []
    for module, name in ((kstore.db.store, "build_tables"), (kstore.db.deadletters, "build_table")):
        original = getattr(module, name, None)
        if original is not None:
            swaps.append((module, name, _memoized(name, original)))
    return swaps


def _memoized(name: str, build: Callable[..., Any]) -> Callable[..., Any]:
    def shared(prefix: str = "kstore_", schema: str | None = None) -> Any:
        key = (name, prefix, schema)
        if key not in _tables:
            _tables[key] = build(prefix, schema)
        return _tables[key]

    return shared


class _TraceHandler(logging.Handler):
    """kstore's log lines go into the schedule's trace, between the turns that wrote them."""

    def __init__(self, trace: list[str]) -> None:
        super().__init__(logging.INFO)
        self.trace = trace

    def emit(self, record: logging.LogRecord) -> None:
        self.trace.append(f"    | {record.levelname.lower()}: {record.getMessage()}")


def run(seed: int, directory: Path, skip: frozenset[str] = frozenset(), actions: Sequence[Action] | None = None,
        keep_db: bool = False) -> Outcome:
    """Run one schedule (its own actions, or ``actions``) and return what happened."""
    started = time.perf_counter()
    rng = random.Random(seed)
    cfg = draw_config(rng, skip, random.Random(f"client {seed}"))
    todo = list(actions) if actions is not None else draw_actions(rng, cfg)
    with _no_collector():
        world = World(seed, cfg, template(directory), directory)
        try:
            violation, state = _play(world, todo)
        finally:
            world.close()
    if violation is None and not keep_db:
        world.db.remove()
    return Outcome(seed, cfg, todo, violation, world.trace, state, world.journal.history, world.crashes,
                   world.delivered, time.perf_counter() - started, Counter(world.db.fired))


def _play(world: World, actions: Sequence[Action]) -> tuple[Violation | None, list[str]]:
    """The actions, then the drain; the first violation stops it (with the state it left)."""
    with patched_kstore(world):
        try:
            for action in actions:
                apply(world, action)
            world.drain()
        except Violation as exc:
            return exc, world.describe()
    return None, []


def signature(violation: Violation) -> str:
    """What makes two violations the same bug: the kind and the first line, numbers left out."""
    first = violation.message.splitlines()[0] if violation.message else ""
    return f"{violation.kind}: {re.sub(r'[0-9]+', '#', first)[:90]}"


def shrink(outcome: Outcome, directory: Path, budget: int = 200) -> Outcome:
    """Delta debugging: drop chunks of actions while the same violation (by signature) still happens."""
    assert outcome.violation is not None
    wanted = signature(outcome.violation)
    best = outcome
    chunk = max(1, len(best.actions) // 2)
    runs = 0
    while chunk >= 1 and runs < budget:
        i, progressed = 0, False
        while i < len(best.actions) and runs < budget:
            trial = best.actions[:i] + best.actions[i + chunk:]
            runs += 1
            got = run(best.seed, directory, best.config.skip, actions=trial)
            if got.violation is not None and signature(got.violation) == wanted:
                best, progressed = got, True
            else:
                i += chunk
        if not progressed:
            chunk //= 2
    return best
