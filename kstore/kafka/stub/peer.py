"""The stub cluster as users and tests make it: :class:`StubCluster`, the in-memory brokers
(:class:`~.cluster.Brokers`) with the seam's three peers on them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .admin import StubAdmin
from .cluster import Brokers
from .consumer import DeferringStubSource, StubSource
from .publisher import StubShardPublisher

if TYPE_CHECKING:
    from kstore.kafka.seam import AdminReader, ConsumerSource
    from kstore.settings import Settings


class StubCluster(Brokers):
    """An in-memory Kafka (see :class:`~.cluster.Brokers` for its arguments) that makes a worker's
    consumer, the brokers' answers and the relay's publisher on itself."""

    # -- the seam's peers --------------------------------------------------------------------------

    def source(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> ConsumerSource:
        """A worker's consumer on this cluster (a :data:`~kstore.kafka.clients.SourceFactory`)."""
        return StubSource(self, settings, group, topics, worker_id)

    def deferring_source(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> ConsumerSource:
        """A worker's consumer with confluent-kafka's threading (see :class:`~.consumer.DeferringStubSource`)."""
        return DeferringStubSource(self, settings, group, topics, worker_id)

    def admin(self, settings: Settings | None = None) -> AdminReader:
        """The brokers' answers for the operator's tools and the relay."""
        return StubAdmin(self, settings)

    def publisher(self, settings: Settings, transactional_id: str, max_record_bytes: int) -> StubShardPublisher:
        """The relay's publisher of one lane (its ``transactional_id``), fencing the lane's earlier one (the
        bound method is a :class:`kstore.relay.publisher.PublisherFactory`)."""
        return StubShardPublisher(self, settings, transactional_id, max_record_bytes)
