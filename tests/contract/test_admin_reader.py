"""What the operator's tools and the relay rely on of the brokers' answers
(:class:`kstore.kafka.seam.AdminReader`), asserted alike of every peer: the stub and the two real
clients.

``kstore offsets`` reads log bounds and offsets by time and commits a group's offsets with their
metadata; ``kstore top`` and the one-database guard read a group's live members; the relay reads a
lane's last progress record (``last_values``) and creates the progress topic (``create_missing``);
a processor's produced records are checked against ``partition_counts``.
"""

from __future__ import annotations

from datetime import datetime, timezone

from kstore.kafka.seam import Committed, GroupView

from .peers import Member, Peer, fetch_until, unique, wait_for


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def test_a_topics_partitions_and_log_bounds(peer: Peer) -> None:
    topic = peer.topic(3)
    peer.produce(topic, 1, [b"a", b"b"])
    reader = peer.admin()
    reader.connect()
    assert reader.partitions(topic) == [0, 1, 2]
    assert reader.partitions(unique("missing")) == []
    assert reader.log_bounds([(topic, 0), (topic, 1)]) == {(topic, 0): (0, 0), (topic, 1): (0, 2)}
    assert reader.log_bounds([]) == {}


def test_offsets_by_time_and_first_timestamps(peer: Peer) -> None:
    topic = peer.topic(1)
    tp = (topic, 0)
    start = 1_700_000_000_000
    peer.produce(topic, 0, [b"a", b"b", b"c"], timestamps_ms=[start, start + 1000, start + 2000])
    reader = peer.admin()
    assert reader.offsets_for_times({tp: at(start + 1)}) == {tp: 1}
    assert reader.offsets_for_times({tp: at(start - 60_000)}) == {tp: 0}
    # No record that late: None, not the log end.
    assert reader.offsets_for_times({tp: at(start + 60_000)}) == {tp: None}
    assert reader.offsets_for_times({}) == {}
    assert reader.first_timestamps({tp: 1}, 10) == {tp: start + 1000}


def test_committed_offsets_round_trip_with_their_metadata(peer: Peer) -> None:
    topic = peer.topic(2)
    reader = peer.admin()
    group = unique("g")
    assert reader.committed(group) == {}
    reader.commit(group, {(topic, 0): 5, (topic, 1): 0}, "kstore-reset by alice")
    assert reader.committed(group) == {(topic, 0): Committed(5, "kstore-reset by alice"),
                                       (topic, 1): Committed(0, "kstore-reset by alice")}
    # A commit replaces the partitions it names and keeps the others.
    reader.commit(group, {(topic, 0): 7}, "inc/7")
    assert reader.committed(group) == {(topic, 0): Committed(7, "inc/7"),
                                       (topic, 1): Committed(0, "kstore-reset by alice")}
    # Another group's offsets are its own.
    assert reader.committed(unique("g")) == {}


def test_the_group_view_names_live_members_and_what_they_are_given(peer: Peer) -> None:
    topic = peer.topic(2)
    reader = peer.admin()
    group = unique("g")
    member = Member(peer.source(group, [topic], "w-view")).subscribe()
    everything = {(topic, 0), (topic, 1)}
    fetch_until([member], lambda: member.given() == everything, "the assignment")
    view = fetch_until([member], lambda: (v := reader.group_view(group)).settled and v, "a settled group")
    assert [(m.member_id, m.client_id) for m in view.members] == [(member.source.member_id, "w-view")]
    assert set(view.members[0].assigned) == everything
    assert view.owners() == {tp: "w-view" for tp in everything}
    member.close()
    wait_for(lambda: reader.group_view(group).members == (), "the member gone from the group")


def test_a_group_with_no_live_member_is_not_settled(peer: Peer) -> None:
    topic = peer.topic(1)
    reader = peer.admin()
    assert reader.group_view(unique("g")) == GroupView((), False)
    group = unique("g")
    member = Member(peer.source(group, [topic])).subscribe()
    fetch_until([member], lambda: member.given() == {(topic, 0)}, "the assignment")
    fetch_until([member], lambda: reader.group_view(group).settled, "a settled group")
    member.close()
    # Kafka's "Empty": no member, nothing settled, as a group that does not exist.
    wait_for(lambda: reader.group_view(group) == GroupView((), False), "the member gone from the group")


def test_partition_counts_and_creating_missing_topics(peer: Peer) -> None:
    topic = peer.topic(2)
    missing = unique("made")
    reader = peer.admin()
    assert reader.partition_counts([topic, missing]) == {topic: 2, missing: 0}
    # Asking never creates a topic.
    assert reader.partition_counts([missing]) == {missing: 0}
    created, counts = reader.create_missing([topic, missing], 3, 1, {"cleanup.policy": "compact"})
    assert created == [missing]
    assert counts == {topic: 2, missing: 3}
    assert reader.create_missing([missing], 5, 1) == ([], {missing: 3})
    reader.add_partitions(missing, 4)
    # Soon, not at once: kafka-python's add_partitions returns once the partitions the brokers
    # describe have leaders, which may be the old ones for a moment yet.
    wait_for(lambda: reader.partition_counts([missing]) == {missing: 4}, "the added partition")
    assert reader.partitions(missing) == [0, 1, 2, 3]


def test_last_values_read_each_partitions_last_record(peer: Peer) -> None:
    topic = peer.topic(3)
    peer.produce(topic, 0, [b"first", b"second", b"last"])
    peer.produce(topic, 1, [b"only"])
    reader = peer.admin()
    tps = [(topic, 0), (topic, 1), (topic, 2)]
    assert reader.last_values(tps, 10) == {(topic, 0): b"last", (topic, 1): b"only", (topic, 2): None}
    peer.produce(topic, 2, [b"later"])
    assert reader.last_values([(topic, 2)], 10) == {(topic, 2): b"later"}
    # Closed, a reader opens its clients again at the next question.
    reader.close()
    assert reader.last_values([(topic, 1)], 10) == {(topic, 1): b"only"}


def test_a_topic_just_created_answers_at_once(peer: Peer) -> None:
    # As the relay does with its progress topic: create it, then read its partitions' last records.
    # A leader that is not ready yet for a moment is asked again, never an error (on confluent-kafka
    # about one topic in three was answered NOT_LEADER_FOR_PARTITION at once): ten topics in a row.
    reader = peer.admin()
    for _ in range(10):
        topic = unique("made")
        reader.create_missing([topic], 2, None, {"cleanup.policy": "compact"})
        tps = [(topic, 0), (topic, 1)]
        assert reader.last_values(tps, 10) == dict.fromkeys(tps)
        assert reader.log_bounds(tps) == dict.fromkeys(tps, (0, 0))
