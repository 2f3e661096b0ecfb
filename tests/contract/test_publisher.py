"""What the outbox relay relies on of a lane's transport (:class:`kstore.relay.publisher.ShardPublisher`),
asserted alike of every peer: the stub and the two real clients.

A transaction publishes a lane's records in order together with its progress record, or nothing of
either; the next owner of the lane's transactional id fences the last one, and reads back the
progress the last committed transaction left (:func:`kstore.relay.progress.lane_progress`).
"""

from __future__ import annotations

import pytest

from kstore.kafka.seam import Fenced, PublishFailed
from kstore.relay.progress import PROGRESS_TOPIC_CONFIG, lane_progress, progress_record, progress_topic, shard_id
from kstore.types import Produced

from .peers import Member, Peer, fetch_for, fetch_until, unique

TIMEOUT_S = 15.0


def published(peer: Peer, topic: str, partitions: int, count: int) -> Member:
    """A ``read_committed`` reader of ``topic`` from its start (a member of a group of its own), once it
    has read ``count`` records."""
    reader = Member(peer.source(unique("reader"), [topic])).subscribe()
    everything = {(topic, p) for p in range(partitions)}
    fetch_until([reader], lambda: reader.given() == everything, "the reader's assignment")
    reader.own(everything, 0)
    fetch_until([reader], lambda: sum(map(len, reader.records.values())) >= count, f"{count} published records")
    return reader


def lane_topics(peer: Peer, group: str, lanes: int) -> None:
    """The group's progress topic, made as the relay makes it."""
    peer.admin().create_missing([progress_topic(group)], lanes, None, PROGRESS_TOPIC_CONFIG)


def test_records_are_published_in_order_with_the_lanes_progress(peer: Peer) -> None:
    out = peer.topic(2)
    group = unique("g")
    lane_topics(peer, group, 2)
    reader = peer.admin()
    assert lane_progress(reader, group, 1, [1, 3], "inc", TIMEOUT_S) == {1: 0, 3: 0}
    transport = peer.publisher(shard_id(group, 1))
    assert transport.ident == shard_id(group, 1)
    records = [Produced(out, b"first", b"k", (("origin", b"shop"), ("empty", b"")), 0),
               Produced(out, b"second", b"k", (), 0),
               Produced(out, None, b"gone", (), 1),
               Produced(out, b"third", b"k", (), 0)]
    transport.publish(records, progress_record(group, 1, "inc", {1: 7, 3: 2}), TIMEOUT_S)
    transport.publish([Produced(out, b"fourth", b"k", (), 0)], progress_record(group, 1, "inc", {1: 8, 3: 2}),
                      TIMEOUT_S)

    read = published(peer, out, 2, 5)
    assert read.values((out, 0)) == [b"first", b"second", b"third", b"fourth"]
    assert read.values((out, 1)) == [None]
    first = read.records[(out, 0)][0]
    assert first.key == b"k"
    assert list(first.headers or ()) == [("origin", b"shop"), ("empty", b"")]
    # The lane's progress is the last committed transaction's; another lane's is its own.
    assert lane_progress(reader, group, 1, [1, 3], "inc", TIMEOUT_S) == {1: 8, 3: 2}
    assert lane_progress(reader, group, 0, [0, 2], "inc", TIMEOUT_S) == {0: 0, 2: 0}
    # Marks of another incarnation of the shards count for nothing.
    assert lane_progress(reader, group, 1, [1, 3], "other", TIMEOUT_S) == {1: 0, 3: 0}


def test_a_new_owner_fences_the_last_and_nothing_of_the_fenced_one_is_read(peer: Peer) -> None:
    out = peer.topic(1)
    group = unique("g")
    lane_topics(peer, group, 1)
    ident = shard_id(group, 0)
    old = peer.publisher(ident)
    old.publish([Produced(out, b"old-1", None, (), 0)], progress_record(group, 0, "inc", {0: 1}), TIMEOUT_S)
    new = peer.publisher(ident)
    with pytest.raises((Fenced, PublishFailed)):
        old.publish([Produced(out, b"zombie", None, (), 0)], progress_record(group, 0, "inc", {0: 9}), TIMEOUT_S)
    reader = peer.admin()
    assert lane_progress(reader, group, 0, [0], "inc", TIMEOUT_S) == {0: 1}
    new.publish([Produced(out, b"new-2", None, (), 0)], progress_record(group, 0, "inc", {0: 2}), TIMEOUT_S)
    read = published(peer, out, 1, 2)
    fetch_for([read], 1.0)
    assert read.values((out, 0)) == [b"old-1", b"new-2"]
    # The reader's position moves past what it is never given (the aborted record, the transactions'
    # markers) up to the log end: the engine moves the stored offset there too.
    (end,) = (end for _, end in reader.log_bounds([(out, 0)]).values())
    fetch_until([read], lambda: read.source.positions([(out, 0)]) == {(out, 0): end}, "the position at the log end")
    assert lane_progress(reader, group, 0, [0], "inc", TIMEOUT_S) == {0: 2}
