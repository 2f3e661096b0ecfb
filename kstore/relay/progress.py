"""The relay's progress in Kafka: where a lane's progress record goes, what it says, and how it is read
back (the one place the format is written; the Kafka clients carry its bytes and read them back raw).

**Progress lives in the Kafka transaction.** Each transaction that publishes a lane's rows also
writes a record to the lane's partition of the group's progress topic (:func:`progress_topic`,
compacted): the last ``seq`` published of each of its shards, after the shards' incarnation
(:func:`progress_mark`: marks left by shards made before, in another database or before they were
made anew, count for nothing). The records and that mark commit together or not at all, so a relay
killed between Kafka's commit and the database's "published" mark (only for clean-up) never
publishes a row twice: the next owner reads the partition's last committed record
(:func:`lane_progress`), after its producer's ``init_transactions`` settled the last owner's transaction.

Relays of earlier versions committed their marks as a group's offsets (:func:`progress_of`): those
are still read, and the further of the two counts.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence

from kstore.kafka.seam import Committed, GroupReader
from kstore.types import Produced
from kstore.types import TopicPartition as TP


def shard_id(group: str, shard: int) -> str:
    """A lane's transactional id (and the group of a shard's progress marks before they moved to
    :func:`progress_topic`, when every shard was a lane): stable, so a new owner fences the old."""
    return f"kstore-outbox.{group}.{shard}"


_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def progress_topic(group: str) -> str:
    """The compacted topic of a group's outbox progress: partition ``n`` is lane ``n``'s, and its last
    record holds the last ``seq`` of each of the lane's shards a committed transaction published
    (:func:`progress_mark`).

    ``kstore-outbox-progress.<group>``; a group name a topic cannot carry is made safe and told apart
    from others by its checksum."""
    name = f"kstore-outbox-progress.{group}"
    if _TOPIC_NAME.fullmatch(name):
        return name
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", group)[:200]
    return f"kstore-outbox-progress.{safe}-{zlib.crc32(group.encode()):08x}"


#: The progress topic's configuration. Compacted: a shard's last mark is kept however long the shard
#: stays idle (a deleted one would make the next owner publish again what it covered). Its segments
#: roll hourly, so compaction has old ones to clean.
PROGRESS_TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.ms": "3600000"}


def progress_mark(incarnation: str, marks: Mapping[int, int]) -> tuple[bytes, bytes]:
    """The key and value of a lane's progress record: the shards' incarnation (marks left by shards
    made before, in another database or before they were made anew, count for nothing), then the
    lane's ``seq``: ``inc/seq`` for a lane of one shard, ``inc/shard:seq,shard:seq...`` for more."""
    if len(marks) == 1:
        ((_, seq),) = marks.items()
        return b"progress", f"{incarnation}/{seq}".encode()
    return b"progress", (f"{incarnation}/" + ",".join(f"{s}:{q}" for s, q in sorted(marks.items()))).encode()


def read_progress_mark(value: bytes | None, incarnation: str, shards: Sequence[int]) -> dict[int, int]:
    """The ``seq`` of each of a lane's ``shards`` its progress record of this incarnation names; none for
    no record, another incarnation's, or one that cannot be read."""
    if value is None:
        return {}
    found, _, body = value.decode(errors="replace").partition("/")
    if found != incarnation:
        return {}
    if body.isdigit():
        return {shards[0]: int(body)} if len(shards) == 1 else {}
    marks: dict[int, int] = {}
    for part in body.split(","):
        shard, _, seq = part.partition(":")
        if not (shard.isdigit() and seq.isdigit()):
            return {}
        marks[int(shard)] = int(seq)
    return {shard: seq for shard, seq in marks.items() if shard in shards}


def progress_record(group: str, lane: int, incarnation: str, marks: Mapping[int, int]) -> Produced:
    """The lane's progress record, as its publisher sends it in each transaction: :func:`progress_mark`
    in the lane's partition of :func:`progress_topic`."""
    key, value = progress_mark(incarnation, marks)
    return Produced(progress_topic(group), value, key, (), lane)


def lane_progress(reader: GroupReader, group: str, lane: int, shards: Sequence[int], incarnation: str,
                  timeout_s: float) -> dict[int, int]:
    """The highest ``seq`` of each of the lane's ``shards`` a committed transaction published (0: none
    yet): the lane's last record in :func:`progress_topic`, and, for a shard it does not name, a mark
    a relay of an earlier version committed as the offset of the shard's own group (:func:`progress_of`),
    whichever is further. Read once, when a publisher starts on the lane (after its
    ``init_transactions`` settled the last owner's transaction)."""
    tp = (progress_topic(group), lane)
    in_topic = read_progress_mark(reader.last_values([tp], timeout_s).get(tp), incarnation, shards)
    return {shard: in_topic[shard] if shard in in_topic and len(shards) > 1
            else max(in_topic.get(shard, 0), progress_of(reader, shard_id(group, shard), f"{incarnation}/"))
            for shard in shards}


def highest_mark(committed: Mapping[TP, Committed], mark: str) -> int:
    """The highest ``seq`` among a shard's progress marks of this incarnation (``mark``); 0 when there is none.

    A mark counts only when its metadata is exactly ``<incarnation>/<seq>`` with ``seq`` its offset:
    metadata read past its end counts for nothing (confluent-kafka reads a committed offset's metadata up
    to a NUL, past its end when there is none: ``<incarnation>/13`` was seen read as ``<incarnation>/135 V``;
    earlier relays ended their marks with one on either client), so a mark is never
    read as further than it is (which would skip rows), at worst not at all (the database's mark
    stands in).
    """
    return max((c.offset for c in committed.values() if c.metadata == f"{mark}{c.offset}"), default=0)


def progress_of(reader: GroupReader, ident: str, mark: str) -> int:
    """The highest ``seq`` in progress group ``ident``'s marks of this incarnation (``mark``)."""
    return highest_mark(reader.committed(ident), mark)
