"""What the engine, the relay and the operator's tools know of Kafka: plain types and the protocols
each client implements (:mod:`kstore.kafka.kafkapython`, :mod:`kstore.kafka.confluent`).

Nothing here imports a client library: a module above the Kafka side imports this, and
:mod:`kstore.kafka.clients` for the implementation the settings choose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

from kstore.partition import TopicPartition as TP
from kstore.records import Record

#: What a client's rebalance callbacks report: partitions given, taken back in a rebalance, or lost
#: (the member's session expired: another member may own them already).
EventKind = Literal["assigned", "revoked", "lost"]

#: The metadata of the offsets kstore mirrors to Kafka (``mirror_offsets``), so a reader can tell them apart.
MIRROR_METADATA = "kstore-mirror"

#: Bookkeeping bytes counted per queued record, besides its key and value (``max_buffered_bytes``).
RECORD_OVERHEAD = 200


def committed_metadata(committed: object) -> str:
    """A committed offset's metadata as it was given: confluent-kafka (2.x) commits it with C's
    terminating NUL, kafka-python without, and kstore reads what either wrote."""
    return (getattr(committed, "metadata", None) or "").rstrip("\x00")


@dataclass(frozen=True)
class GroupMember:
    """A live member of a group: its member id, its client id, and the database an older kstore
    worker told in its subscription (None from any other member)."""

    member_id: str
    client_id: str
    told_database: str | None = None


@dataclass(frozen=True)
class GroupView:
    """A group's live members, and whether it was settled (``Stable``: no rebalance under way)."""

    members: tuple[GroupMember, ...]
    settled: bool


class Fenced(Exception):
    """Another relay initialised this shard's transactional id: this producer is done."""


class PublishFailed(Exception):
    """A transaction did not commit (it was aborted, or its outcome is not known yet).

    ``seq`` names the row the broker refused, when it was one row's fault (too large, an
    unknown topic): the relay stops on it rather than skip it.
    """

    def __init__(self, reason: str, seq: int | None = None) -> None:
        super().__init__(reason)
        self.seq = seq


def shard_id(group: str, shard: int) -> str:
    """The shard's transactional id and progress group: stable, so a new owner fences the old."""
    return f"kstore-outbox.{group}.{shard}"


#: A refused partition's offset when the client has no position for it at all.
NO_POSITION = -1


class Refused(NamedTuple):
    """A partition the client cannot fetch at its position: the offset it stopped at (None: not
    said), and why when the log was truncated below it (an unclean leader election)."""

    tp: TP
    offset: int | None
    truncated: str | None = None


class Fetched(NamedTuple):
    """What one fetch brought: records by partition (each partition's in offset order), and the
    partitions the client could not fetch."""

    records: Sequence[tuple[TP, Sequence[Record]]]
    refused: Sequence[Refused] = ()


#: What a client's rebalance callbacks call, on the client's own thread: it must not block.
OnRebalance = Callable[[EventKind, list[TP]], None]


class ConsumerSource(Protocol):
    """The worker's consumer, as the engine sees it: a client fetches, reports rebalances, and
    seeks, pauses and resumes when told. Every partition's state is the engine's
    (:class:`kstore.engine.partitions.Partitions`); a client keeps none of it.

    Threads: :meth:`fetch`, :meth:`positions` and :meth:`flush_mirror` are the fetch thread's;
    :meth:`seek`, :meth:`pause`, :meth:`resume` and :meth:`release` come from either thread under
    the engine's lock (a client that may not be called while it fetches records them and carries
    them out before its next fetch); the brokers' answers (:meth:`log_bounds`,
    :meth:`offsets_for_times`, :meth:`group_members`) are the main thread's, never under that lock.
    """

    settings: Any
    group: str
    topics: list[str]
    worker_id: str
    #: Rebalances seen so far, and this member's id in the group as of the last (the one-database guard).
    joins: int
    member_id: str | None
    #: The queued records are :class:`kstore.Message` tuples already (a processor that deserializes
    #: nothing is handed them as they are).
    queues_messages: ClassVar[bool]
    #: :meth:`group_members` can describe the group (the one-database guard needs it).
    describes_group: ClassVar[bool]
    #: The rebalance callbacks run on the fetch thread, inside :meth:`fetch`, while the main thread
    #: never waits on the client under the engine's lock: the engine may apply a revoke at once.
    callbacks_may_lock: ClassVar[bool]

    def size_of(self, records: Sequence[Any]) -> int:
        """Approximate memory of fetched records, for ``max_buffered_bytes``."""

    def check_topics(self) -> None:
        """Raise ConfigurationError (one line) if a subscribed topic does not exist, BrokerError if
        the brokers do not answer."""

    def subscribe(self, on_rebalance: OnRebalance) -> None:
        """Join the group; every partition given is paused, and reported, before anything is fetched."""

    def fetch(self, timeout_ms: int, max_records: int) -> Fetched:
        """Wait up to ``timeout_ms`` for records, at most ``max_records`` (rebalance callbacks may
        run meanwhile). Raises BrokerError if the client failed for good."""

    def positions(self, tps: Sequence[TP]) -> dict[TP, int]:
        """Where the client fetches each partition next, from its local state (after a fetch)."""

    def seek(self, tp: TP, offset: int) -> None: ...
    def pause(self, tps: Sequence[TP]) -> None: ...
    def resume(self, tps: Sequence[TP]) -> None: ...

    def release(self, tps: Sequence[TP]) -> None:
        """kstore no longer delivers ``tps``: forget any seek or resume still to be carried out,
        and pause those still assigned."""

    def assignment(self) -> set[TP]: ...

    def highwater(self, tp: TP) -> int | None:
        """The high watermark the last fetch reported (None: not known yet). Any thread, no broker call."""

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        """``(log start, log end)`` of each partition, asked of the brokers (BrokerError if they do not answer)."""

    def offsets_for_times(self, targets: dict[TP, datetime]) -> dict[TP, int | None]: ...

    def group_stable(self) -> bool: ...

    def group_members(self) -> GroupView: ...

    def mirror(self, offsets: Mapping[TP, int]) -> None:
        """Committed offsets to copy to Kafka's (``mirror_offsets``) at the next :meth:`flush_mirror`."""

    def flush_mirror(self) -> None: ...

    def close(self) -> None:
        """Leave the group, committing nothing to Kafka (after the fetch thread stopped)."""
