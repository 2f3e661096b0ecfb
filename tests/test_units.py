"""Unit tests of pure logic: reset targets, settings, retry policy and bookkeeping."""

from __future__ import annotations

import gc
import random
from datetime import datetime, timezone

import pytest

from kstore import EARLIEST, LATEST, ConfigurationError, RetryPolicy, Settings
from kstore.engine.failures import Failures
from kstore.engine.worker import GC_YOUNG_THRESHOLD, PYTHON_GC_THRESHOLDS, tune_collector
from kstore.retry import Retry
from kstore.targets import check_target, policy_offset

BOUNDS = (10, 100)


@pytest.mark.parametrize(("target", "expected"), [
    (10, 10), (55, 55), (100, 100), (EARLIEST, 10), (LATEST, 100),
])
def test_valid_targets(target: object, expected: int) -> None:
    assert check_target(target, BOUNDS, None) == (expected, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("target", "problem"), [
    (9, "below the log start 10"), (101, "past the log end 100"),
])
def test_invalid_targets_say_why(target: int, problem: str) -> None:
    offset, why = check_target(target, BOUNDS, None)
    assert offset is None and why is not None and problem in why


def test_datetime_target_uses_kafkas_answer_or_is_invalid() -> None:
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert check_target(when, BOUNDS, 42) == (42, None)
    offset, why = check_target(when, BOUNDS, None)
    assert offset is None and why is not None and "no record at or after 2026-01-01" in why


def test_bad_target_type_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        check_target("10", BOUNDS, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        check_target(True, BOUNDS, None)


def test_policy_offsets() -> None:
    assert policy_offset("earliest", BOUNDS, None) == 10
    assert policy_offset("latest", BOUNDS, None) == 100
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert policy_offset(when, BOUNDS, 33) == 33
    assert policy_offset(when, BOUNDS, None) == 100, "a time after every record starts at the end"


def test_settings_from_env_types_and_overrides() -> None:
    s = Settings.from_env({"KSTORE_MAX_BATCH_SIZE": "7", "KSTORE_TOPICS": "a, b", "KSTORE_STRICT_RESETS": "yes",
                           "KSTORE_TEST_WHATEVER": "ignored", "PATH": "/bin"}, group="g", dsn=None)
    assert (s.max_batch_size, s.topics, s.strict_resets, s.group) == (7, ("a", "b"), True, "g")
    assert s.dsn == "sqlite:///kstore.db"


@pytest.mark.parametrize(("env", "message"), [
    ({"KSTORE_MAX_BATCH": "5"}, "unknown setting in environment: KSTORE_MAX_BATCH"),
    ({"KSTORE_MAX_BATCH_SIZE": "x"}, "KSTORE_MAX_BATCH_SIZE='x' is not a valid int"),
    ({"KSTORE_MAX_BATCH_SIZE": "0"}, "max_batch_size must be positive"),
    ({"KSTORE_START_FROM": "2026-01-01T00:00:00"}, "needs a timezone"),
    ({"KSTORE_ON_ERROR": "ignore"}, "on_error must be stop or dead_letter"),
])
def test_bad_settings_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        Settings.from_env(env)


def test_safe_dsn_masks_the_password() -> None:
    s = Settings(dsn="postgresql+psycopg2://app:hunter2@db/app")
    assert "hunter2" not in s.safe_dsn and "app:***@db" in s.safe_dsn


def test_backoff_grows_is_capped_and_jittered() -> None:
    policy = RetryPolicy(backoff_s=1, multiplier=2, max_backoff_s=5, jitter=0.2)
    rng = random.Random(1)
    delays = [policy.delay(n, rng) for n in (1, 2, 3, 4, 10)]
    for got, base in zip(delays, [1, 2, 4, 5, 5], strict=True):
        assert 0.8 * base <= got <= 1.2 * base


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


@pytest.mark.parametrize(("before", "after"), [
    (PYTHON_GC_THRESHOLDS, (GC_YOUNG_THRESHOLD, *PYTHON_GC_THRESHOLDS[1:])),
    ((1000, 5, 5), (1000, 5, 5)),  # the process chose its own: left alone
])
def test_a_worker_raises_the_collectors_young_threshold_unless_the_process_set_its_own(
        before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
    saved = gc.get_threshold()
    try:
        gc.set_threshold(*before)
        tune_collector()
        assert gc.get_threshold() == after
    finally:
        gc.set_threshold(*saved)
