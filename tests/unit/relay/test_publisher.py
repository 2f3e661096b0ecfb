"""A lane's publisher, on the in-memory stub cluster: the relay writes the progress record and reads it
back; the client's publisher only carries the bytes it is given (a transport), fenced by the next one."""

from __future__ import annotations

import pytest

from kstore import Settings
from kstore.kafka.seam import Fenced
from kstore.kafka.stub import StubCluster
from kstore.relay.progress import progress_mark, progress_topic, read_progress_mark
from kstore.relay.publisher import LanePublisher
from kstore.types import Produced

GROUP = "shop"


@pytest.fixture
def cluster() -> StubCluster:
    found = StubCluster(blocking=False)
    found.create_topic("orders", 1)
    found.create_topic(progress_topic(GROUP), 2)
    return found


def settings() -> Settings:
    return Settings(dsn="sqlite://", bootstrap_servers="stub:9092", group=GROUP)


def test_each_transaction_carries_the_lanes_progress_record_and_a_new_publisher_reads_it_back(
        cluster: StubCluster) -> None:
    lane = LanePublisher(cluster.publisher, settings(), GROUP, 1, "inc")
    lane.publish([Produced("orders", b"a", b"k")], {1: 7, 9: 3}, 5)
    (value,) = [m.value for m in cluster.records((progress_topic(GROUP), 1))]
    assert value == progress_mark("inc", {1: 7, 9: 3})[1], "the lane's partition holds the relay's encoding"
    assert read_progress_mark(value, "inc", [1, 9]) == {1: 7, 9: 3}
    assert cluster.records((progress_topic(GROUP), 0)) == [], "another lane's partition is untouched"
    again = LanePublisher(cluster.publisher, settings(), GROUP, 1, "inc")
    assert again.progress(cluster.admin(settings()), [1, 9]) == {1: 7, 9: 3}
    other = LanePublisher(cluster.publisher, settings(), GROUP, 1, "made-anew")
    assert other.progress(cluster.admin(settings()), [1, 9]) == {1: 0, 9: 0}, (
        "another incarnation's marks count for nothing")


def test_a_lanes_next_publisher_fences_the_last_one(cluster: StubCluster) -> None:
    first = LanePublisher(cluster.publisher, settings(), GROUP, 0, "inc")
    second = LanePublisher(cluster.publisher, settings(), GROUP, 0, "inc")
    assert first.ident == second.ident == f"kstore-outbox.{GROUP}.0"
    with pytest.raises(Fenced):
        first.publish([Produced("orders", b"zombie", b"k")], {0: 1}, 5)
    second.publish([Produced("orders", b"live", b"k")], {0: 1}, 5)
    assert [m.value for m in cluster.records(("orders", 0))] == [b"live"], "nothing of the fenced one landed"
