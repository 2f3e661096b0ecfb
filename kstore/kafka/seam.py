"""What the engine, the relay and the operator's tools know of Kafka: plain types and the protocols
each client implements (:mod:`kstore.kafka.kafkapython`, :mod:`kstore.kafka.confluent`).

Nothing here imports a client library: a module above the Kafka side imports this, and
:mod:`kstore.kafka.clients` for the implementation the settings choose. The relay's publishers are
transports: they carry records and a progress record already encoded, and read raw values back
(:meth:`GroupReader.last_values`); the progress format and the publisher protocol are the relay's
(:mod:`kstore.relay.progress`, :mod:`kstore.relay.publisher`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol

from kstore.errors import BrokerError
from kstore.types import Record
from kstore.types import TopicPartition as TP

if TYPE_CHECKING:
    from kstore.settings import Settings

log = logging.getLogger(__name__)

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
    """A live member of a group: its member id, its client id, the database an older kstore
    worker told in its subscription (None from any other member), and the partitions it is assigned."""

    member_id: str
    client_id: str
    told_database: str | None = None
    #: Not part of who the member is (equality, hashing): it moves with every rebalance.
    assigned: tuple[TP, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GroupView:
    """A group's live members, and whether it was settled (``Stable``: no rebalance under way)."""

    members: tuple[GroupMember, ...]
    settled: bool

    def owners(self, registered: Collection[str] | None = None) -> dict[TP, str]:
        """Which live member is assigned each partition, by its client id (a kstore worker's name, as
        in its logs and the database, unless ``client_id`` is set); with ``registered`` (the names
        and Kafka member ids of the workers a database's registry holds for the group), only the
        members it names: those that write to that database."""
        owners: dict[TP, str] = {}
        for member in self.members:
            who = member.client_id or member.member_id
            if registered is not None and who not in registered and member.member_id not in registered:
                continue
            for tp in member.assigned:
                owners[tp] = who
        return owners


class Committed(NamedTuple):
    """A group's committed offset of one partition, and its metadata as it was given."""

    offset: int
    metadata: str


class Fenced(Exception):
    """Another relay initialised this shard's transactional id: this producer is done."""


class PublishFailed(Exception):
    """A transaction did not commit (it was aborted, or its outcome is not known yet).

    ``row`` names the record the broker refused (its index among those given to ``publish``), when it
    was one record's fault (too large, an unknown topic): the relay stops on it rather than skip it.
    """

    def __init__(self, reason: str, row: int | None = None) -> None:
        super().__init__(reason)
        self.row = row


def offsets_refused(servers: str, group: str, reasons: str) -> BrokerError:
    """An :meth:`AdminReader.commit` the brokers refused, worded alike on either client."""
    return BrokerError(f"Kafka at {servers} refused the offsets of group {group!r}: {reasons}")


#: A partition's last record is looked for among its last TAIL_FIRST offsets, then, each time none
#: is found there (aborted transactions, their markers), TAIL_GROWTH times further back.
TAIL_FIRST = 4
TAIL_GROWTH = 8


def tail_value(tp: TP, bounds: tuple[int, int], read: Callable[[TP, int, int], list[bytes | None]]) -> bytes | None:
    """The value of a partition's last committed record: ``read(tp, first, end)`` gives the values of the
    committed records from ``first`` up to ``end`` (the partition's ``bounds``: log start, last stable
    offset); it is asked of the last few offsets first, then further back, until a record is found."""
    start, end = bounds
    back = TAIL_FIRST
    while end > start:
        first = max(start, end - back)
        values = read(tp, first, end)
        if values:
            return values[-1]
        if first == start:
            break
        back *= TAIL_GROWTH
    return None


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

    settings: Settings
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


class GroupReader(Protocol):
    """What the relay asks the brokers besides publishing: a group's committed offsets (a shard's
    progress) and its live members (to find relays whose worker left)."""

    def committed(self, group: str) -> dict[TP, Committed]:
        """The group's committed offsets in Kafka, with their metadata (none: an empty dict)."""
        ...

    def group_view(self, group: str) -> GroupView:
        """The group's live members and whether it is settled. Raises BrokerError."""
        ...

    def last_values(self, tps: Sequence[TP], timeout_s: float) -> dict[TP, bytes | None]:
        """The value of each partition's last committed record (read as ``read_committed``: records of
        aborted or open transactions are not seen; None: the partition has none). Raises BrokerError,
        also when the records were not read within ``timeout_s``."""
        ...

    def close(self) -> None:
        """Close its clients; a later question opens them again."""
        ...


class AdminReader(GroupReader, Protocol):
    """Questions to the brokers for the operator's tools (``kstore offsets``, ``top``, the exporter,
    ``topics``, lag, dead-letter replays) and the relay, made the same on either client.

    Every failure is :class:`~kstore.errors.BrokerError`, one line. Brokers answer "not now" for a
    moment after they start or while leadership moves: such an answer is asked again (a debug line
    each time) for up to the reader's patience (``connect_timeout_s`` unless given), then is one line.
    Clients are opened at the first question that needs them; :meth:`close` closes them and the
    next question opens them again.
    """

    def connect(self) -> None:
        """Open the clients now, so that a mistake in the connection settings (TLS, SASL, an address
        where no broker listens) is named before any other answer is read."""
        ...

    def partitions(self, topic: str) -> list[int]:
        """The topic's partitions, sorted; none for a topic the cluster does not have."""
        ...

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        """``(log start, log end)`` of each partition."""
        ...

    def offsets_for_times(self, targets: Mapping[TP, datetime]) -> dict[TP, int | None]:
        """The first offset at or after each time (None: no record that late)."""
        ...

    def commit(self, group: str, offsets: Mapping[TP, int], metadata: str) -> None:
        """Commit ``offsets`` for ``group`` (which must have no live member). Raises BrokerError if refused."""
        ...

    def first_timestamps(self, offsets: Mapping[TP, int], timeout_s: float) -> dict[TP, int | None]:
        """One record of each partition, from its offset on: its timestamp in ms (None: the record has
        none). A partition whose record did not arrive within ``timeout_s`` is left out."""
        ...

    def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        """Each topic's partitions, 0 for a topic the cluster does not have (never created by asking)."""
        ...

    def create_missing(self, topics: Sequence[str], partitions: int | None, replication_factor: int | None,
                       config: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, int]]:
        """Create those of ``topics`` the cluster does not have (None: the brokers' defaults), with
        ``config`` as their topic configuration, and wait until each has its leaders. Returns the
        topics created and every topic's partitions afterwards."""
        ...

    def add_partitions(self, topic: str, total: int) -> None:
        """Give ``topic`` partitions up to ``total`` in all, and wait until each has its leader."""
        ...


class PartitionCounts:
    """How many partitions each topic has, for checking what a processor produces before it reaches
    the outbox (:func:`kstore.running.handler.produce_check`), asked of the readers ``open_reader`` makes.

    Each answer is trusted for ``topic_recheck_s``, then asked again with a fresh metadata request
    (never one that could create the topic): a missing topic may have been created meanwhile, and a
    topic found may have been deleted. A failed question leaves the last answer (or, for a topic never
    found, "unknown": the record goes on and the relay publishes it when it can).
    """

    def __init__(self, settings: Settings, open_reader: Callable[[], AdminReader]) -> None:
        self.settings = settings
        self._open_reader = open_reader
        self._reader: AdminReader | None = None
        #: topic -> (partitions, when to ask again)
        self._known: dict[str, tuple[int, float]] = {}
        self._unreachable_until = 0.0

    def count(self, topic: str) -> int | None:
        """The topic's partitions (0: the cluster has no such topic); None if the brokers did not answer."""
        known = self._known.get(topic)
        now = time.monotonic()
        if known is not None and now < known[1]:
            return known[0]
        if now < self._unreachable_until:
            return None if known is None else known[0]
        try:
            if self._reader is None:
                self._reader = self._open_reader()
            found = self._reader.partition_counts([topic])[topic]
        except BrokerError as exc:
            log.debug("could not look topic %r up: %s", topic, exc)
            self._unreachable_until = now + self.settings.topic_recheck_s
            self.close()  # a new client next time: this one may be stuck on a broker that left
            return None if known is None else known[0]
        if known is not None and (known[0] > 0) != (found > 0):
            log.info("topic %r %s", topic, "exists again" if found else "no longer exists")
        self._known[topic] = (found, time.monotonic() + self.settings.topic_recheck_s)
        return found

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
