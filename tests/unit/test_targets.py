"""Reset targets (kstore.targets): which offsets a target names within a partition's log, and why one is refused."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kstore import EARLIEST, LATEST
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
