"""What the engine relies on of a worker's consumer (:class:`kstore.kafka.seam.ConsumerSource`),
asserted alike of every peer: the stub and the two real clients.

The engine's invariants (:mod:`kstore.engine`) rest on these: a partition's assignment is reported
before any of its records, and none is fetched before the claim seeks and resumes it ("claim before
resume"); a seek places the next fetch exactly; a pause stops delivery; the positions after a fetch
are past what it returned; a partition that cannot be fetched at its position is refused, not moved
silently; the rebalance events, applied in order, give the assignment.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kstore.errors import ConfigurationError
from kstore.kafka.seam import MIRROR_METADATA, RECORD_OVERHEAD, Committed
from kstore.types import TopicPartition as TP
from kstore.types import timestamp_ms

from .peers import Member, Peer, fetch_for, fetch_until, unique, wait_for

#: Long enough that a peer delivering what it must not (a paused partition) would have done so:
#: every fetch is 100 ms, and records are already in the log.
QUIET_S = 1.5


def joined(peer: Peer, topic: str, partitions: int) -> Member:
    """A member of a new group, subscribed to ``topic`` and given its partitions."""
    member = Member(peer.source(unique("g"), [topic])).subscribe()
    fetch_until([member], lambda: member.given() == {(topic, p) for p in range(partitions)}, "the assignment")
    return member


def refused_at(member: Member, tp: TP, offset: int) -> bool:
    """Whether the member's fetches refused ``tp`` at ``offset`` (or at a position they did not name).

    A refusal may also name a position from before the engine's last seek (librdkafka's placeholder of
    a new assignment, fetched from for a moment before its pause): the engine seeks such a partition
    again (:meth:`kstore.engine.partitions.Partitions._refused`). None says the log was truncated.
    """
    mine = [r for r in member.refused if r.tp == tp]
    assert all(r.truncated is None for r in mine), mine
    return any(r.offset in (offset, None) for r in mine)


def test_an_unknown_topic_is_named_before_subscribing(peer: Peer) -> None:
    topic = peer.topic(1)
    peer.source(unique("g"), [topic]).check_topics()
    missing = unique("missing")
    with pytest.raises(ConfigurationError, match=missing):
        peer.source(unique("g"), [topic, missing]).check_topics()


def test_the_assignment_is_reported_before_any_record_and_nothing_is_fetched_before_the_claim(peer: Peer) -> None:
    topic = peer.topic(2)
    for p in range(2):
        peer.produce(topic, p, [b"a", b"b", b"c"])
    member = joined(peer, topic, 2)
    tps = {(topic, 0), (topic, 1)}
    # The first event naming a partition gives it (a client may report an empty revoke on joining).
    assert next(e for e in member.events if e[1]) == ("assigned", sorted(tps))
    assert member.source.assignment() == tps
    assert member.source.joins >= 1 and member.source.member_id
    # Every assigned partition is paused until the engine's claim seeks and resumes it: fetching on,
    # with records in the log, delivers none of them.
    fetch_for([member], QUIET_S)
    assert not member.records
    # A seek alone does not resume it either.
    member.source.seek((topic, 0), 1)
    fetch_for([member], QUIET_S)
    assert not member.records
    member.own(tps, 0)
    fetch_until([member], lambda: all(len(member.records[tp]) == 3 for tp in tps), "every record")
    assert not member.unannounced
    assert wait_for(member.source.group_stable, "a stable group")


def test_a_seek_places_the_next_fetch_exactly_and_positions_follow_what_was_fetched(peer: Peer) -> None:
    topic = peer.topic(1)
    tp = (topic, 0)
    peer.produce(topic, 0, [f"v{i}".encode() for i in range(10)])
    member = joined(peer, topic, 1)
    member.own([tp], 4)
    # A fetch returns at most the records asked for (the engine sizes it by the room in its queues).
    sizes = [sum(len(records) for _, records in member.fetch(max_records=2).records) for _ in range(20)]
    assert max(sizes) == 2, sizes
    fetch_until([member], lambda: len(member.records[tp]) >= 6, "offsets 4..9")
    assert member.offsets(tp) == list(range(4, 10))
    assert member.values(tp) == [f"v{i}".encode() for i in range(4, 10)]
    assert {r.topic for r in member.records[tp]} == {topic}
    assert {r.partition for r in member.records[tp]} == {0}
    assert member.source.positions([tp]) == {tp: 10}
    assert wait_for(lambda: member.source.highwater(tp) == 10, "the high watermark")
    # Back again: the next records are those from there on, none from before.
    member.records.clear()
    member.source.seek(tp, 2)
    fetch_until([member], lambda: len(member.records[tp]) >= 8, "offsets 2..9 again")
    assert member.offsets(tp) == list(range(2, 10))
    assert member.source.positions([tp]) == {tp: 10}


def test_records_come_in_offset_order_with_their_keys_headers_and_timestamps(peer: Peer) -> None:
    topic = peer.topic(1)
    tp = (topic, 0)
    stamps = [1_700_000_000_000 + i for i in range(5)]
    peer.produce(topic, 0, [b"x", None, b"z", b"", b"w"], key=b"k", timestamps_ms=stamps)
    member = joined(peer, topic, 1)
    member.own([tp], 0)
    fetch_until([member], lambda: len(member.records[tp]) == 5, "five records")
    records = member.records[tp]
    assert [r.offset for r in records] == [0, 1, 2, 3, 4]
    assert [r.value for r in records] == [b"x", None, b"z", b"", b"w"]
    assert {r.key for r in records} == {b"k"}
    assert [timestamp_ms(r) for r in records] == stamps
    assert member.source.size_of(records) >= RECORD_OVERHEAD * 5


def test_a_pause_stops_delivery_and_a_resume_goes_on_where_it_stopped(peer: Peer) -> None:
    topic = peer.topic(2)
    paused, other = (topic, 0), (topic, 1)
    member = joined(peer, topic, 2)
    member.own([paused, other], 0)
    peer.produce(topic, 0, [b"0", b"1", b"2"])
    fetch_until([member], lambda: len(member.records[paused]) == 3, "the first records")
    member.source.pause([paused])
    fetch_for([member], 0.3)  # the last fetch in flight before the pause (librdkafka) may still land
    before = len(member.records[paused])
    peer.produce(topic, 0, [b"3", b"4"])
    peer.produce(topic, 1, [b"other"])
    fetch_until([member], lambda: member.values(other) == [b"other"], "the other partition's record")
    fetch_for([member], QUIET_S)
    assert len(member.records[paused]) == before == 3
    member.source.resume([paused])
    fetch_until([member], lambda: len(member.records[paused]) == 5, "the records after the pause")
    assert member.offsets(paused) == [0, 1, 2, 3, 4]


def test_a_released_partition_forgets_its_seek_and_resume(peer: Peer) -> None:
    topic = peer.topic(2)
    kept, released = (topic, 0), (topic, 1)
    peer.produce(topic, 0, [b"a"])
    peer.produce(topic, 1, [b"b"])
    member = joined(peer, topic, 2)
    # The engine dropped the partition (fenced, say) after its claim had sought and resumed it, before
    # the fetch thread carried those out: nothing of it may be delivered now.
    member.own([kept, released], 0)
    member.source.release([released])
    fetch_until([member], lambda: member.records[kept], "the kept partition's record")
    fetch_for([member], QUIET_S)
    assert not member.records[released]
    assert member.source.assignment() == {kept, released}  # released by kstore, still Kafka's assignment
    # A later claim places it as any other.
    member.own([released], 0)
    fetch_until([member], lambda: member.values(released) == [b"b"], "the released partition's record once owned")


def test_a_position_past_the_log_end_is_refused_not_moved_and_a_seek_places_it_again(peer: Peer) -> None:
    topic = peer.topic(1)
    tp = (topic, 0)
    peer.produce(topic, 0, [b"0", b"1", b"2"])
    member = joined(peer, topic, 1)
    member.own([tp], 10)
    fetch_until([member], lambda: refused_at(member, tp, 10), "the partition refused at 10")
    assert not member.records[tp]
    # The engine pauses a refused partition and places it again: it is fetched from there.
    member.source.pause([tp])
    member.own([tp], 1)
    fetch_until([member], lambda: member.offsets(tp) == [1, 2], "offsets 1..2 after the refusal")


def test_a_position_below_the_log_start_is_refused_not_moved(peer: Peer) -> None:
    topic = peer.topic(1)
    tp = (topic, 0)
    peer.produce(topic, 0, [f"{i}".encode() for i in range(6)])
    peer.delete_records(topic, 0, 4)
    member = joined(peer, topic, 1)
    member.own([tp], 1)
    fetch_until([member], lambda: refused_at(member, tp, 1), "the partition refused at 1")
    assert not member.records[tp]  # never moved to the log start by itself: records 1..3 are gone
    assert member.source.log_bounds([tp]) == {tp: (4, 6)}
    member.source.pause([tp])
    member.own([tp], 4)
    fetch_until([member], lambda: member.offsets(tp) == [4, 5], "offsets 4..5 from the new log start")


def test_log_bounds_and_offsets_by_time_are_the_brokers(peer: Peer) -> None:
    topic = peer.topic(2)
    start = 1_700_000_000_000
    peer.produce(topic, 0, [b"a", b"b", b"c"], timestamps_ms=[start, start + 1000, start + 2000])
    source = peer.source(unique("g"), [topic])
    tps = [(topic, 0), (topic, 1)]
    assert source.log_bounds(tps) == {(topic, 0): (0, 3), (topic, 1): (0, 0)}

    def at(ms: int) -> datetime:
        return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)

    found = source.offsets_for_times({(topic, 0): at(start + 500)})
    assert found == {(topic, 0): 1}
    assert source.offsets_for_times({(topic, 0): at(start)}) == {(topic, 0): 0}
    assert source.offsets_for_times({(topic, 0): at(start + 60_000)}) == {(topic, 0): None}


def test_the_group_describes_this_member(peer: Peer) -> None:
    topic = peer.topic(1)
    member = joined(peer, topic, 1)
    source = member.source
    view = wait_for(lambda: (v := source.group_members()).settled and v, "a settled group")
    assert [(m.member_id, m.client_id) for m in view.members] == [(source.member_id, source.worker_id)]


def test_a_second_member_takes_part_of_the_assignment_and_the_events_say_so(peer: Peer) -> None:
    topic = peer.topic(4)
    everything = {(topic, p) for p in range(4)}
    for p in range(4):
        peer.produce(topic, p, [f"{p}".encode()])
    group = unique("g")
    first = Member(peer.source(group, [topic], "first")).subscribe()
    fetch_until([first], lambda: first.given() == everything, "the first member's assignment")
    first.own(everything, 0)
    fetch_until([first], lambda: sum(map(len, first.records.values())) == 4, "the first member's records")

    second = Member(peer.source(group, [topic], "second")).subscribe()

    def settled() -> bool:
        mine, theirs = first.given(), second.given()
        return bool(mine and theirs and not mine & theirs and mine | theirs == everything
                    and first.source.assignment() == mine and second.source.assignment() == theirs)

    fetch_until([first, second], settled, "the partitions shared between the two members")
    moved = second.given()
    # Each partition that moved was revoked from the first member before the second was given it
    # (the events are what the engine drops and claims by).
    assert moved <= first.named("revoked") | first.named("lost")
    assert next(e for e in second.events if e[1])[0] == "assigned"
    # What the second member was given is paused until its claim, as at the first assignment.
    fetch_for([first, second], QUIET_S)
    assert not second.records
    assert not first.unannounced and not second.unannounced

    # Each claims what it was given (the first member again where it was, whether its partitions were
    # revoked and given back, eager, or kept, cooperative): each is then delivered only its own.
    kept = first.given()
    first.own(kept, 1)
    second.own(moved, 0)
    for p in range(4):
        peer.produce(topic, p, [f"{p}-after".encode()])
    fetch_until([first, second], lambda: all(len(first.records[tp]) == 2 for tp in kept)
                and all(len(second.records[tp]) == 2 for tp in moved), "the records after the rebalance")
    fetch_for([first, second], 0.5)
    assert all(first.offsets(tp) == [0, 1] for tp in kept)
    assert all(first.offsets(tp) == [0] for tp in moved)  # nothing since it moved
    assert all(second.offsets(tp) == [0, 1] for tp in moved)

    # The first member leaves: the second is given everything.
    first.close()
    fetch_until([second], lambda: second.given() == everything == second.source.assignment(),
                "every partition given to the member left")


def test_mirrored_offsets_reach_the_group_with_their_mark(peer: Peer) -> None:
    topic = peer.topic(2)
    member = joined(peer, topic, 2)
    group = member.source.group
    member.source.mirror({(topic, 0): 3, (unique("other"), 0): 5})
    member.source.flush_mirror()
    reader = peer.admin()
    # Only the assigned partition's offset goes to Kafka, committed with kstore's mark.
    committed = fetch_until([member], lambda: reader.committed(group), "the mirrored offset")
    assert committed == {(topic, 0): Committed(3, MIRROR_METADATA)}
