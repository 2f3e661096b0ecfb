"""A worker's threads, simulated on one thread by preemption points.

The real worker runs its main loop (``step``) and its fetcher (``fetch_once`` in a
loop) on two threads, and a client may run the rebalance callbacks on a third (kafka-python's
IO thread) while the fetcher is inside its fetch. Here one thread runs every turn;
at a preemption point, with the schedule's ``preempt`` probability, another of the
same worker's threads takes a whole turn first:

- the main thread is about to run an SQL statement, or to take ``KafkaSource.lock``:
  the IO thread runs the group's join step (rebalance callbacks only; a client with
  confluent-kafka's threading has none: nothing happens), or the fetcher runs a whole
  ``fetch_once`` (only if the lock is free: it takes it);
- the fetcher is inside the stub's fetch (after the join step; after the fetch, positions
  already moved), has queued what it fetched but not applied the rebalance events,
  or is about to take the lock: the main thread runs a whole ``step``.

Besides, a ``reset_offsets`` the schedule armed for a worker runs on a "caller" thread
(an operator's request handled in-process) at one of the main thread's statements or
lock acquisitions, while a batch may be in flight.

Preemption does not nest: a turn taken at a preemption point has none itself.
A worker's turns never interleave with another worker's: SQLite has one writer,
and a transaction of one worker held open while another runs would only wait.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kstore.kafka.stub import StubMember

    from .world import Member

MAIN, FETCHER = "main", "fetcher"
#: Another thread of the process calling the worker's API (``reset_offsets``).
CALLER = "caller"


class Threads:
    """Which thread of each worker is running, and the preemption points (see the module docstring)."""

    def __init__(self, rng: random.Random, probability: float, live: Callable[[str], Member | None],
                 trace: list[str]) -> None:
        self.rng = rng
        self.probability = probability
        self._live = live
        self.trace = trace
        self._running: dict[str, str] = {}
        self._nested = False

    @contextmanager
    def running(self, name: str, thread: str) -> Iterator[None]:
        """A turn of one of worker ``name``'s threads."""
        before = self._running.get(name)
        self._running[name] = thread
        try:
            yield
        finally:
            if before is None:
                del self._running[name]
            else:
                self._running[name] = before

    def _point(self, name: str) -> Member | None:
        """The member whose other thread takes a turn here, if one does."""
        if self._nested or not self.probability or self._running.get(name) is None:
            return None
        if self.rng.random() >= self.probability:
            return None
        return self._live(name)

    @contextmanager
    def _nesting(self) -> Iterator[None]:
        self._nested = True
        try:
            yield
        finally:
            self._nested = False

    def at_statement(self, name: str) -> None:
        """The main thread is about to run an SQL statement (the fetcher runs none)."""
        self._caller(name)
        m = self._point(name)
        if m is not None:
            self._fetcher_or_io(m, "a statement")

    def at_lock(self, name: str) -> None:
        """A thread of ``name`` is about to take ``KafkaSource.lock``, which nobody holds."""
        self._caller(name)
        m = self._point(name)
        if m is None:
            return
        if self._running.get(name) == FETCHER:
            self._main(m, "the fetcher takes the lock")
        else:
            self._fetcher_or_io(m, "the main thread takes the lock")

    def in_poll(self, consumer: StubMember, stage: str) -> None:
        """The fetcher is inside its fetch (or just out of it), holding no lock."""
        m = self._point(consumer.name)
        if m is not None:
            self._main(m, f"the fetcher is inside poll(), {stage}")

    def _caller(self, name: str) -> None:
        """A reset_offsets armed for the worker runs now, half the time, if the main thread holds no lock."""
        m = self._live(name)
        partitions = None if m is None else m.partitions
        if (m is None or m.armed_reset is None or self._nested or self._running.get(name) != MAIN
                or partitions is None or partitions.lock._is_owned() or self.rng.random() < 0.5):
            return
        (index, fraction), m.armed_reset = m.armed_reset, None
        with self._nesting():
            m.world.reset_turn(m, index, fraction, nested=True)

    def _fetcher_or_io(self, m: Member, where: str) -> None:
        partitions = m.partitions
        if partitions is None or m.consumer is None:
            return
        with self._nesting():
            if partitions.lock._is_owned() or self.rng.random() < 0.5:
                if m.consumer.io_step():
                    self.trace.append(f"  {m.name}: its IO thread ran a rebalance before {where}")
            else:
                self.trace.append(f"  {m.name}: fetch before {where}")
                m.world.fetch_turn(m, nested=True)

    def _main(self, m: Member, where: str) -> None:
        with self._nesting():
            self.trace.append(f"  {m.name}: step while {where}")
            m.world.step_turn(m, nested=True)


class PreemptingLock:
    """``KafkaSource.lock``: an RLock whose acquisition, when nobody holds it, is a preemption point."""

    def __init__(self, threads: Threads, name: str) -> None:
        self._lock = threading.RLock()
        self._threads = threads
        self._name = name

    def __enter__(self) -> bool:
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            self._threads.at_lock(self._name)
        return self._lock.__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._lock.__exit__(kind, exc, tb)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def _is_owned(self) -> bool:
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]
