"""Waiting out a missing output topic: :class:`TopicWait`.

A topic the processor produces to that the cluster does not have (not created yet, or deleted
while the worker runs) is an outage, like a database that does not answer: the batch is rolled
back and put back, nothing is dead-lettered, and it is tried again after a backoff. Whether the
topic exists again is asked of the brokers at most every ``topic_recheck_s`` (see
:class:`kstore.kafka.seam.PartitionCounts`), so the backoff only spaces the attempts.
"""

from __future__ import annotations

import logging
import time

from kstore.errors import MissingTopicError
from kstore.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: First and longest wait before a batch that met a missing topic is tried again.
TOPIC_RETRY_DELAY = 0.5
TOPIC_RETRY_MAX_DELAY = 10.0


class TopicWait:
    """The backoff of batches that met a missing topic, and what /readyz says meanwhile."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._delay = TOPIC_RETRY_DELAY
        self._not_before = 0.0
        #: Why batches wait (the error's text), from a batch that met a missing topic to one that committed.
        self.missing: str | None = None

    def ready(self) -> bool:
        return time.monotonic() >= self._not_before

    def failed(self, exc: MissingTopicError) -> None:
        """A batch was rolled back for a missing topic: said once (then at DEBUG), and waited out."""
        self._metrics.rolled_back("missing_topic")
        delay = self._delay
        self._delay = min(self._delay * 2, TOPIC_RETRY_MAX_DELAY)
        self._not_before = time.monotonic() + delay
        text = str(exc)
        (log.debug if text == self.missing else log.warning)(
            "%s; the batch was rolled back and waits for it (nothing is dead-lettered); retrying in %.1fs",
            text, delay)
        self.missing = text

    def succeeded(self) -> None:
        if self.missing is not None:
            log.info("the output topic is back: processing again")
        self.missing = None
        self._delay = TOPIC_RETRY_DELAY
        self._not_before = 0.0
