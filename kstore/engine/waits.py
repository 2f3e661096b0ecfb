"""Waiting out an outage a batch met outside the database: :class:`OutageWait`.

A topic the processor produces to that the cluster does not have (not created yet, or deleted
while the worker runs), or a schema registry that does not answer, is an outage, like a database
that does not answer: the batch is rolled back and put back, nothing is dead-lettered, and it is
tried again after a backoff. Whether a missing topic exists again is asked of the brokers at most
every ``topic_recheck_s`` (see :class:`kstore.kafka.seam.PartitionCounts`), so the backoff only
spaces the attempts.
"""

from __future__ import annotations

import logging
import time

from kstore.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: First and longest wait before a batch that met an outage is tried again.
RETRY_DELAY = 0.5
RETRY_MAX_DELAY = 10.0


class OutageWait:
    """The backoff of batches that met one kind of outage, and what /readyz says meanwhile."""

    def __init__(self, metrics: Metrics, reason: str, back: str) -> None:
        self._metrics = metrics
        #: The label of ``kstore_batches_rolled_back_total`` the attempts count under.
        self._reason = reason
        #: Said once the outage is over.
        self._back = back
        self._delay = RETRY_DELAY
        self.not_before = 0.0
        #: Why batches wait (the error's text), from a batch that met the outage to one that committed.
        self.missing: str | None = None

    def ready(self) -> bool:
        return time.monotonic() >= self.not_before

    def failed(self, exc: Exception) -> None:
        """A batch was rolled back for the outage: said once (then at DEBUG), and waited out."""
        self._metrics.rolled_back(self._reason)
        delay = self._delay
        self._delay = min(self._delay * 2, RETRY_MAX_DELAY)
        self.not_before = time.monotonic() + delay
        text = str(exc)
        (log.debug if text == self.missing else log.warning)(
            "%s; the batch was rolled back and waits (nothing is dead-lettered); retrying in %.1fs", text, delay)
        self.missing = text

    def succeeded(self) -> None:
        if self.missing is not None:
            log.info("%s: processing again", self._back)
        self.missing = None
        self._delay = RETRY_DELAY
        self.not_before = 0.0
