"""What the engine, the relay and the operator's tools know of Kafka: plain types and the protocols
each client implements (:mod:`kstore.kafka.kafkapython`, :mod:`kstore.kafka.confluent`).

Nothing here imports a client library: a module above the Kafka side imports this, and
:mod:`kstore.kafka.clients` for the implementation the settings choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
