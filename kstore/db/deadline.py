"""A deadline on every round trip of kstore's PostgreSQL connections.

A database that stops answering without closing the connection (a network
partition, a failover that leaves the old address silent, a hung PgBouncer or
load balancer) would otherwise hang a worker forever inside ``recv()``. Two
layers bound that, and the worker then resolves what was in flight (a COMMIT
without an answer is read back, see :mod:`kstore.engine.commit`):

- **TCP keepalives and ``tcp_user_timeout``** (libpq parameters set by
  :func:`connect_args`): the kernel gives up on a peer that stops acknowledging.
  This catches real network partitions, idle or busy, but not a middlebox whose
  own TCP stack still answers while it forwards nothing.
- **A deadline per round trip** (this module's watchdog thread): every
  ``execute``, ``executemany``, ``commit`` and ``rollback`` on a kstore
  connection is armed with ``db_timeout_s``; if no answer came by then, the
  watchdog shuts the socket down under libpq, whose blocked ``recv()`` returns
  and the driver raises "server closed the connection unexpectedly" (armed by kstore's
  connection classes, :mod:`kstore.db.dbapi`: psycopg2's cursors, ``copy_expert`` included;
  psycopg 3's ``Connection.wait``, which every round trip, COPY included, goes through). That catches
  every silence, whatever the network does, at the cost of capping how long one
  statement may run (raise ``db_timeout_s`` for processors that run long ones).

Threading: the watchdog thread only calls ``shutdown()`` on a duplicate of the
socket's descriptor, under its own lock, for a round trip still armed; it
never touches psycopg2 objects. Round trips disarm before they return.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

#: Kernel-level detection, in seconds: probes after this much silence, then every
#: interval, and the connection is dropped after this many unanswered probes.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3


class Watchdog:
    """Cuts the socket of a round trip that outlives its deadline. One thread for the process."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._armed: dict[int, tuple[float, int]] = {}  # token -> (deadline, fd)
        self._heap: list[tuple[float, int]] = []
        self._tokens = itertools.count(1)
        self._thread: threading.Thread | None = None
        #: Round trips cut, for tests and logs.
        self.cuts = 0

    @contextmanager
    def guard(self, fd: int, seconds: float) -> Iterator[None]:
        """Arm a deadline of ``seconds`` on socket ``fd`` for the block."""
        token = self._arm(fd, seconds)
        try:
            yield
        finally:
            with self._lock:
                self._armed.pop(token, None)
                self._compact()

    def _compact(self) -> None:
        """Drop disarmed entries once they outnumber the armed ones (lock held). Round trips
        disarm long before their deadline, so without this the heap would keep an entry per
        round trip of the last ``db_timeout_s`` seconds: hundreds of thousands under load."""
        if len(self._heap) > 64 + 2 * len(self._armed):
            self._heap = [(deadline, token) for token, (deadline, _) in self._armed.items()]
            heapq.heapify(self._heap)

    def _arm(self, fd: int, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        with self._lock:
            token = next(self._tokens)
            self._armed[token] = (deadline, fd)
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kstore-db-deadline", daemon=True)
                self._thread.start()
            if self._heap[0][1] == token:  # the thread sleeps until the earliest deadline: wake it for a new one
                self._lock.notify()
        return token

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._heap and (self._heap[0][1] not in self._armed or self._heap[0][0] <= now):
                    _, token = heapq.heappop(self._heap)
                    armed = self._armed.pop(token, None)
                    if armed is not None:
                        self._cut(armed[1])
                wait = self._heap[0][0] - now if self._heap else None
                self._lock.wait(wait)

    def _cut(self, fd: int) -> None:
        """Shut the socket down under libpq (lock held): its blocked recv() returns at once."""
        self.cuts += 1
        log.warning("a database round trip got no answer within its deadline: cutting the connection")
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError as exc:  # closed meanwhile: nothing left to cut
            log.debug("cutting a database connection failed: %s", exc)


WATCHDOG = Watchdog()


def connect_args(timeout_s: float, given: dict[str, Any]) -> dict[str, Any]:
    """libpq connection arguments for silent-network detection; ``given`` (the DSN's query
    string) wins, so a user can tune or turn off any of them. (The deadline per round trip is
    armed by kstore's connection classes: :mod:`kstore.db.dbapi`.)"""
    args: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": KEEPALIVE_IDLE_S,
        "keepalives_interval": KEEPALIVE_INTERVAL_S,
        "keepalives_count": KEEPALIVE_COUNT,
    }
    if timeout_s > 0:
        args["tcp_user_timeout"] = int(timeout_s * 1000)
        args["connect_timeout"] = max(2, int(timeout_s))
    return {k: v for k, v in args.items() if k not in given}
