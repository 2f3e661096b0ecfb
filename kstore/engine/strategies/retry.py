"""Retry in place: a message that fails alone is attempted again after the processor's
:class:`~kstore.retry.RetryPolicy` backoff, until the policy is exhausted (``max_attempts``, or a final
error: ``give_up_on``); then the next strategy decides (dead-letter it, or stop).

Every attempt is counted (:meth:`kstore.engine.failures.Failures.message_failed`), exhausted or not:
the count is what the next strategy reports.
"""

from __future__ import annotations

import logging

from kstore.telemetry.metrics import Metrics

from ..failures import Failures
from .base import AGAIN, Failed, Strategy, Verdict, fields, where

#: The batches' logger: these lines are a batch's, as they always were.
log = logging.getLogger("kstore.engine.batches")


class RetryInPlace(Strategy):
    """Retries a failing message where it is, after a backoff, while its policy allows."""

    def __init__(self, failures: Failures, metrics: Metrics) -> None:
        self.failures, self.metrics = failures, metrics

    def failed(self, failed: Failed) -> Verdict | None:
        failures = self.failures
        record = failed.taken.records[0]
        failure = failed.failure = failures.message_failed((record.topic, record.partition, record.offset),
                                                           failed.cause)
        if failures.exhausted(failure):
            return None
        self.metrics.retried()
        log.warning("%s failed (attempt %d of %d): %s; retrying", where(record), failure.attempts,
                    failures.policy.max_attempts, failure.logged, extra=fields(record))
        return AGAIN
