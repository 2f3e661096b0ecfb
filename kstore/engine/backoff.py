"""The delay between a worker's retries of an outage (the database, or the brokers a claim asks),
shared by the worker's loop and its batches.

Invariant: the delay doubles with each failure up to its longest and goes back to the first
after a success; :attr:`Backoff.failing` is true exactly from a failure to the next success
(what ``/readyz`` reports, naming :attr:`Backoff.away`). An outage is waited out, never a message's failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kstore.db.sqlerrors import first_line
from kstore.errors import BrokerError

#: The worker's logger: a database retry is the worker's line, as it always was.
log = logging.getLogger("kstore.engine.worker")


class Backoff:
    """Exponential delay between retries of an outage, reset by a success."""

    def __init__(self, first: float, longest: float, on_failure: Callable[[], None] | None = None) -> None:
        self.first = first
        self.longest = longest
        self.delay = first
        self.not_before = 0.0
        #: True from a failure until the next success: a dependency is away (for /readyz).
        self.failing = False
        #: Which dependency the last failure found away, as /readyz says it.
        self.away = "the database is not answering"
        self._on_failure = on_failure

    def ready(self) -> bool:
        return time.monotonic() >= self.not_before

    def failed(self, what: str, exc: BaseException) -> float:
        self.failing = True
        broker = isinstance(exc, BrokerError)
        self.away = f"the {'Kafka brokers are' if broker else 'database is'} not answering"
        if self._on_failure is not None and not broker:
            self._on_failure()
        delay = self.delay
        self.delay = min(self.delay * 2, self.longest)
        self.not_before = time.monotonic() + delay
        log.warning("%s error, could not %s: %s; retrying in %.1fs", "Kafka" if broker else "database", what,
                    first_line(exc), delay)
        return delay

    def succeeded(self) -> None:
        self.failing = False
        self.delay = self.first
        self.not_before = 0.0
