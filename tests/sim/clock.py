"""A scripted clock in place of the ``time`` module in kstore's modules, and a
condition variable that never blocks (one thread: nobody else could notify it)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time as real_time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, TracebackType
from typing import Any

#: Wall-clock seconds at simulated monotonic time 0 (2023-11-14).
EPOCH_BASE = 1_700_000_000.0


class SimClock:
    """Stands in for the ``time`` module: ``monotonic()``, ``time()``, ``sleep()``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def time(self) -> float:
        return EPOCH_BASE + self.now

    def time_ns(self) -> int:
        return int(self.time() * 1e9)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def ms(self) -> int:
        """Milliseconds since the epoch, for record timestamps."""
        return int(self.time() * 1000)


class SimCondition:
    """``threading.Condition(lock)`` on one thread: a wait times out at once, moving the clock.

    No other thread exists to notify it, so waiting ``timeout`` seconds is all a
    wait can do; the clock moves by that much (so a loop waiting for a deadline ends).
    """

    def __init__(self, lock: Any, clock: SimClock) -> None:
        self._lock = lock
        self.clock = clock
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.clock.advance(timeout or 0.0)
        return False

    def notify(self, n: int = 1) -> None:
        pass

    def notify_all(self) -> None:
        pass

    def __enter__(self) -> bool:
        return bool(self._lock.__enter__())

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._lock.__exit__(kind, exc, tb)


@contextmanager
def patched_time(clock: SimClock) -> Iterator[list[str]]:
    """Replace the ``time`` module by ``clock`` in every loaded kstore module; yields their names."""
    # Not kstore.db.deadline: PostgreSQL only, and its watchdog is a real thread that may be
    # alive in this process (other tests) and must keep the real clock.
    patched = [m for m in _kstore_modules()
               if getattr(m, "time", None) is real_time and m.__name__ != "kstore.db.deadline"]
    for module in patched:
        module.time = clock  # type: ignore[attr-defined]
    try:
        yield [m.__name__ for m in patched]
    finally:
        for module in patched:
            module.time = real_time  # type: ignore[attr-defined]


_modules: tuple[int, list[ModuleType]] = (0, [])


def _kstore_modules() -> list[ModuleType]:
    """All of kstore's modules, imported now: one imported in the middle of a schedule (kstore
    imports some lazily) would keep the real clock for that schedule."""
    global _modules
    if _modules[0] != len(sys.modules):
        import kstore

        # Every subpackage's modules too; not the CLI's __main__, not the migrations (a wheel ships them inside).
        for info in pkgutil.walk_packages(kstore.__path__, "kstore."):
            if not info.ispkg and info.name != "kstore.__main__" and not info.name.startswith("kstore.migrations."):
                importlib.import_module(info.name)
        found = [m for name, m in list(sys.modules.items())
                 if m is not None and (name == "kstore" or name.startswith("kstore."))]
        _modules = (len(sys.modules), found)
    return _modules[1]
