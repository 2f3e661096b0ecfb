"""Reset targets: what a caller may ask a partition to move to, and checking it.

Pure logic, no I/O: the caller fetches the partition's log bounds (and the
offset for a time) from Kafka and this module decides.
"""

from __future__ import annotations

import enum
from datetime import datetime


class Position(enum.Enum):
    """The two ends of a partition's log."""

    EARLIEST = "earliest"
    LATEST = "latest"

    def __repr__(self) -> str:
        return self.name


EARLIEST = Position.EARLIEST
LATEST = Position.LATEST

Target = int | datetime | Position


def check_target(target: Target, bounds: tuple[int, int], time_offset: int | None) -> tuple[int | None, str | None]:
    """Resolve ``target`` within ``bounds`` = (log start, log end).

    Returns ``(offset, None)`` when valid, ``(None, why)`` when not. The log
    end is a valid target: the partition then waits for the next record.
    ``time_offset`` is Kafka's answer for a datetime target (None: no record
    at or after that time).
    """
    start, end = bounds
    if isinstance(target, Position):
        return (start if target is EARLIEST else end), None
    if isinstance(target, datetime):
        if time_offset is None:
            return None, f"no record at or after {target.isoformat()} (log end is {end})"
        return time_offset, None
    if isinstance(target, bool) or not isinstance(target, int):
        raise TypeError(f"a reset target is an int offset, a datetime, EARLIEST or LATEST, not {target!r}")
    if target < start:
        return None, f"offset {target} is below the log start {start} (deleted by retention?)"
    if target > end:
        return None, f"offset {target} is past the log end {end}"
    return target, None


def policy_offset(policy: str | datetime, bounds: tuple[int, int], time_offset: int | None) -> int:
    """Where the start policy puts a partition: earliest, latest or the first record at/after a time.

    A time later than every record means "from the next record on": the log end.
    """
    start, end = bounds
    if policy == "earliest":
        return start
    if policy == "latest" or time_offset is None:
        return end
    return time_offset
