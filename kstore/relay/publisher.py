"""A lane's publisher: the Kafka client's transactional producer (the transport, :class:`ShardPublisher`),
and :class:`LanePublisher`, which puts the lane's progress record in each of its transactions and
reads the progress back.

The transports live with their clients (:mod:`kstore.kafka.confluent.producer`,
:mod:`kstore.kafka.kafkapython.producer`) and satisfy :class:`ShardPublisher` by their shape: they
carry records and an already-encoded progress record, and know nothing of the progress format
(:mod:`kstore.relay.progress`), which is the relay's alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kstore.kafka.seam import GroupReader
from kstore.settings import Settings
from kstore.types import Produced

from .progress import lane_progress, progress_record, shard_id


class ShardPublisher(Protocol):
    """A transactional producer for one lane of one group's outbox (the relay's Kafka side; a lane
    publishes one shard or several: :mod:`kstore.relay.lanes`).

    Made by a :class:`PublisherFactory`, which initialises the lane's transactional id
    (:func:`~kstore.relay.progress.shard_id`): that finishes or aborts the last owner's open
    transaction and fences its producer. Each :meth:`publish` commits its records and the lane's
    progress record in one Kafka transaction, so the progress is never ahead of or behind what was
    published. (The mark is a record, not an offset committed with ``send_offsets_to_transaction``:
    that added two round trips to the group coordinator to every transaction.)
    """

    #: The lane's transactional id.
    ident: str

    def publish(self, records: Sequence[Produced], mark: Produced, timeout_s: float) -> None:
        """Publish ``records``, in order, then ``mark`` (the lane's progress record), in one transaction.

        Raises :class:`~kstore.kafka.seam.Fenced` (this producer is done) or
        :class:`~kstore.kafka.seam.PublishFailed` (the transaction was aborted or its outcome is
        unknown: close this producer and make a new one, which settles it, then read the progress
        again); its ``row`` names the record to blame, None when it was the progress record or no one record.
        """
        ...

    def close(self) -> None:
        """Drop the producer (what is not committed is aborted by the next owner or the broker)."""
        ...


class PublisherFactory(Protocol):
    """A client's :class:`ShardPublisher` class: made for a lane's transactional id, fencing any earlier
    producer of it. Raises :class:`~kstore.kafka.seam.Fenced`, BrokerError or ConfigurationError."""

    def __call__(self, settings: Settings, transactional_id: str, max_record_bytes: int) -> ShardPublisher: ...


class LanePublisher:
    """One lane's producer as the relay uses it: each transaction carries the lane's progress mark
    (:func:`~kstore.relay.progress.progress_record`), and :meth:`progress` reads the last one back."""

    def __init__(self, factory: PublisherFactory, settings: Settings, group: str, lane: int,
                 incarnation: str) -> None:
        self.settings = settings
        self.group, self.lane, self.incarnation = group, lane, incarnation
        self.transport = factory(settings, shard_id(group, lane), settings.outbox_max_record_bytes)
        self.ident = self.transport.ident

    def progress(self, reader: GroupReader, shards: Sequence[int]) -> dict[int, int]:
        """The highest ``seq`` of each of the lane's ``shards`` a committed transaction recorded (0: none
        yet). Read after the factory's fencing: no commit of this lane can be pending any more."""
        return lane_progress(reader, self.group, self.lane, shards, self.incarnation,
                             self.settings.connect_timeout_s)

    def publish(self, records: Sequence[Produced], marks: Mapping[int, int], timeout_s: float) -> None:
        """Publish ``records``, in order, in one transaction with the progress mark ``marks`` (each of
        the lane's shards' last ``seq`` once it commits); raises as :meth:`ShardPublisher.publish`."""
        self.transport.publish(records, progress_record(self.group, self.lane, self.incarnation, marks), timeout_s)

    def close(self) -> None:
        self.transport.close()
