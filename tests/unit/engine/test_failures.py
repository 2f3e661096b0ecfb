"""The engine's failure bookkeeping (kstore.engine.failures.Failures): a failed batch is split until the
bad message is alone, counted against its attempts, and forgotten when the partition is no longer owned."""

from __future__ import annotations

import pytest

from kstore import RetryPolicy
from kstore.engine.failures import Failures
from kstore.retry import Retry


def test_failures_isolate_a_failed_batch_until_past_it() -> None:
    failures = Failures(RetryPolicy(max_attempts=2, backoff_s=0))
    assert failures.batch_size(500) == 500
    failures.batch_failed([("t", 0, 5), ("t", 0, 6), ("t", 1, 9)])
    assert failures.batch_size(500) == 1
    failures.done([("t", 0, 5), ("t", 0, 6)])
    assert failures.batch_size(500) == 2, "partition 1 is still being isolated, in batches twice as large"
    failure = failures.message_failed(("t", 1, 9), ValueError("bad"))
    assert (failure.attempts, failures.exhausted(failure)) == (1, False)
    assert failure.error == "ValueError: bad"
    failure = failures.message_failed(("t", 1, 9), Retry("later", delay=0))
    assert failures.exhausted(failure)
    failures.done([("t", 1, 9)])
    assert failures.batch_size(500) == 500


def _transactions_past_a_poison(n: int, poison: int, batch: int) -> tuple[int, list[int]]:
    """Drive Failures as the worker does over offsets 0..n-1 of one partition, one of them
    failing every attempt (then dead-lettered): transactions run, and offsets committed in order."""
    failures = Failures(RetryPolicy(max_attempts=2, backoff_s=0))
    committed: list[int] = []
    position = transactions = 0
    while position < n:
        transactions += 1
        taken = list(range(position, min(n, position + failures.batch_size(batch))))
        keys = [("t", 0, o) for o in taken]
        if poison not in taken:
            committed += taken
            failures.done(keys)
            position = taken[-1] + 1
        elif len(taken) > 1:
            failures.batch_failed(keys)
        elif failures.exhausted(failures.message_failed(keys[0], ValueError("bad"))):
            failures.done(keys)  # dead-lettered
            position += 1
    return transactions, committed


@pytest.mark.parametrize("poison", [0, 1, 2499, 2500, 4998, 4999])
def test_a_bad_message_in_a_large_batch_is_found_in_few_transactions(poison: int) -> None:
    transactions, committed = _transactions_past_a_poison(10_000, poison, batch=5000)
    assert committed == [o for o in range(10_000) if o != poison], "every good message once, in order"
    # One by one, getting past it took up to 5,000 transactions; halving on failure and doubling on
    # success, a few times log2(5000) = 12.3.
    assert transactions <= 50, transactions


def test_failures_forget_partitions_no_longer_owned() -> None:
    failures = Failures(RetryPolicy())
    failures.batch_failed([("t", 0, 5), ("t", 1, 5)])
    failures.retain({("t", 1)})
    failures.done([("t", 1, 5)])
    assert failures.batch_size(10) == 10
