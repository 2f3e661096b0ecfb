"""The outbox's progress marks in their topic: the topic's name, a mark's encoding, and finding a
partition's last committed record among aborted transactions and their markers."""

from __future__ import annotations

import random

import pytest

from kstore.kafka.seam import tail_value
from kstore.relay.lanes import MAX_LANES, lane_shards, lanes_of
from kstore.relay.progress import progress_mark, progress_topic, read_progress_mark
from kstore.types import TopicPartition as TP


def test_a_group_name_a_topic_can_carry_is_kept_and_any_other_is_made_safe_and_told_apart() -> None:
    assert progress_topic("orders") == "kstore-outbox-progress.orders"
    odd, other = progress_topic("shop web/1"), progress_topic("shop web/2")
    assert odd.startswith("kstore-outbox-progress.shop_web_1-")
    assert other.startswith("kstore-outbox-progress.shop_web_2-")
    assert progress_topic("a b") != progress_topic("a_b"), "two groups never share a progress topic"
    assert len(progress_topic("g" * 400)) <= 249


def test_a_mark_counts_only_for_its_own_incarnation() -> None:
    _, value = progress_mark("inc1", {0: 42})
    assert value == b"inc1/42", "a lane of one shard writes what relays did before lanes"
    assert read_progress_mark(value, "inc1", [0]) == {0: 42}
    assert read_progress_mark(value, "inc2", [0]) == {}
    assert read_progress_mark(None, "inc1", [0]) == {}
    assert read_progress_mark(b"inc1/4x", "inc1", [0]) == {}


def test_a_lane_of_several_shards_marks_each_and_reads_back_its_own() -> None:
    marks = {3: 17, 11: 0, 19: 250_000}
    _, value = progress_mark("inc", marks)
    assert read_progress_mark(value, "inc", [3, 11, 19]) == marks
    assert read_progress_mark(value, "inc", [3, 19]) == {3: 17, 19: 250_000}, "only the lane's shards"
    assert read_progress_mark(value, "other", [3, 11, 19]) == {}
    assert read_progress_mark(b"inc/17", "inc", [3, 11]) == {}, "a one-shard mark says nothing of a lane of two"
    assert read_progress_mark(b"inc/3:17,11:x", "inc", [3, 11]) == {}, "a mark it cannot read counts for nothing"


@pytest.mark.parametrize("shards", [1, 2, 7, 8, 9, 16, 64, 100])
def test_lanes_cover_each_shard_once_and_keep_one_lane_per_shard_up_to_the_limit(shards: int) -> None:
    lanes = lanes_of(shards)
    assert lanes == min(shards, MAX_LANES)
    covered = [s for lane in range(lanes) for s in lane_shards(lane, shards)]
    assert sorted(covered) == list(range(shards)), "every shard in exactly one lane"
    if shards <= MAX_LANES:
        assert all(lane_shards(lane, shards) == (lane,) for lane in range(lanes)), "as before lanes: lane n is shard n"
    sizes = [len(lane_shards(lane, shards)) for lane in range(lanes)]
    assert max(sizes) - min(sizes) <= 1, "lanes share the shards evenly"


def _partition(rng: random.Random, records: int) -> list[bytes | None]:
    """A progress partition as offsets: a committed record (its value), or None for what a read_committed
    reader never sees (a record of an aborted transaction, a transaction's marker)."""
    log: list[bytes | None] = []
    for n in range(records):
        for _ in range(rng.choice([0, 0, 1, 5, 40])):  # aborted transactions before this one: record, marker
            log += [None, None]
        log += [f"inc/{n}".encode(), None]  # the record, then its commit marker
    return log


@pytest.mark.parametrize("seed", range(30))
def test_the_last_committed_record_is_found_however_far_back_it_is(seed: int) -> None:
    rng = random.Random(seed)
    log = _partition(rng, rng.randint(0, 6))
    start = rng.randint(0, 3) if log else 0  # the log may start later (deleted segments)
    asked: list[tuple[int, int]] = []

    def read(tp: TP, first: int, end: int) -> list[bytes | None]:
        asked.append((first, end))
        assert start <= first < end <= len(log)
        return [v for v in log[first:end] if v is not None]

    expected = next((v for v in reversed(log[start:]) if v is not None), None)
    assert tail_value(("p", 0), (start, len(log)), read) == expected
    if asked:
        assert asked[-1][0] == start or expected is not None, "it gives up only after reading from the log start"
    assert len(asked) <= 6, "it looks further back by a factor each time"


def test_an_empty_partition_is_not_read() -> None:
    def read(tp: TP, first: int, end: int) -> list[bytes | None]:
        raise AssertionError("nothing to read")

    assert tail_value(("p", 0), (7, 7), read) is None
