"""A partition and a position in it, by plain values: the names every part of kstore shares.

Imports nothing: every module of kstore may use it.
"""

from __future__ import annotations

from typing import NamedTuple

#: A partition by plain values, ``(topic, partition_id)``: what users pass and the tables key on.
TopicPartition = tuple[str, int]


class Position(NamedTuple):
    """What a batch commits for one partition: the compare-and-set on its offsets row."""

    #: The ``next_offset`` the row must still hold (this worker's last commit, claim or reset).
    expected: int
    #: The ``next_offset`` written: one past the batch's last record of the partition.
    next: int
    #: The epoch the row must still hold (this worker's claim).
    epoch: int
