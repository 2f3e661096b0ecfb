"""Isolate: a failed batch of several messages is narrowed down to the message that fails.

It is retried in batches half as large, from one of its partitions at a time, until the failing
message runs alone (:meth:`kstore.engine.failures.Failures.batch_failed` keeps the window); no
attempt is counted against any message meanwhile. A batch of one message is left to the next strategy.
"""

from __future__ import annotations

import logging

from ..failures import Failures
from .base import AGAIN, Failed, Strategy, Verdict

#: The batches' logger: these lines are a batch's, as they always were.
log = logging.getLogger("kstore.engine.batches")


class Isolate(Strategy):
    """Narrows a failed batch of several messages down, in batches half as large."""

    def __init__(self, failures: Failures) -> None:
        self.failures = failures

    def failed(self, failed: Failed) -> Verdict | None:
        failures, batch = self.failures, failed.taken.records
        if len(batch) <= 1:
            return None
        # One line when a failure is first met; the narrowing down that follows is DEBUG.
        already = any(failures.isolating((r.topic, r.partition)) for r in batch[:1])
        (log.debug if already else log.warning)(
            "a batch of %d failed (%s); retrying it in smaller batches to find the bad message",
            len(batch), failures.describe(failed.cause))
        failures.batch_failed([(r.topic, r.partition, r.offset) for r in batch])
        return AGAIN
