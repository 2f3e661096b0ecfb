"""The retry policy (kstore.retry.RetryPolicy): how long a failed message waits before its next attempt."""

from __future__ import annotations

import random

from kstore import RetryPolicy


def test_backoff_grows_is_capped_and_jittered() -> None:
    policy = RetryPolicy(backoff_s=1, multiplier=2, max_backoff_s=5, jitter=0.2)
    rng = random.Random(1)
    delays = [policy.delay(n, rng) for n in (1, 2, 3, 4, 10)]
    for got, base in zip(delays, [1, 2, 4, 5, 5], strict=True):
        assert 0.8 * base <= got <= 1.2 * base
