"""An in-memory Kafka behind the seam, for tests: yours and kstore's (its simulation runs on it).

:class:`StubCluster` holds topics, partition logs, consumer groups and their committed offsets, and
makes the seam's three peers on them: a worker's consumer (:meth:`StubCluster.source`, a
:class:`~kstore.kafka.seam.ConsumerSource` factory, with kafka-python's threading: rebalance
callbacks may come from a background thread; :meth:`StubCluster.deferring_source`, with
confluent-kafka's: callbacks only inside a fetch, seeks and pauses carried out by the next fetch),
the operator's and the relay's questions (:meth:`StubCluster.admin`, an
:class:`~kstore.kafka.seam.AdminReader`) and the relay's publisher (:meth:`StubCluster.publisher`,
a :class:`kstore.relay.publisher.PublisherFactory`). It imports no Kafka client library. A worker
runs on it with its source factory set; its offsets still live in the database its settings name::

    from kstore import Settings, Worker
    from kstore.kafka.stub import StubCluster

    cluster = StubCluster(blocking=False)  # turn by turn: no fetch waits (worker.run() wants the default)
    cluster.create_topic("orders", 2)
    cluster.produce("orders", 0, b'{"id": 1}')
    worker = Worker(OrderProcessor(), Settings(dsn="sqlite:///t.db", bootstrap_servers="stub:9092", relay=False))
    worker.source_factory = cluster.source
    worker.start()
    worker.fetch_once()  # joins the group: the partitions are assigned, paused until claimed
    worker.step()        # claims them (seeking each to its stored offset)
    worker.fetch_once()  # fetches
    worker.step()        # processes a batch, committing its offsets in the database

What it promises (what kstore relies on of a real cluster and client):

- Per partition, an append-only log whose offsets are dense from its log start
  (:meth:`StubCluster.delete_records` moves the start); records keep their key, value, headers
  and timestamp (the cluster's ``clock``, unless given).
- Eager rebalances with generations: a member joins, leaves (``close``) or is expelled
  (:meth:`StubCluster.expel`, a session timeout); every member then takes a join step (inside its
  next fetch), which reports everything it held as revoked, and once all have, the group assigns
  the subscribed partitions round robin and each member reports its whole new assignment. An
  expelled member is not told: it learns at its next join step (``lost``), and joins again.
- The rebalance events the real clients post (``assigned``, ``revoked``, ``lost``); every
  partition assigned is paused and has no position until the engine seeks it; a partition whose
  position is unknown or out of the log is refused (:class:`~kstore.kafka.seam.Refused`), never
  reset. Seek, pause and resume skip a partition no longer assigned.
- Committed offsets per group with their metadata (the admin's ``commit``, refused while the group
  has live members; ``mirror_offsets``), a group's view of its members, offsets by time.

What it does not model: brokers that fail or answer late, replication and leaders, retention by
time or size, compaction, the incremental and KIP-848 rebalance protocols, static membership,
transactions that are visible before they commit or stay open (a publisher's transaction appends
its records and progress mark at once, or nothing), and any waiting: a fetch returns at once.

Injection points (the simulation uses them): the ``clock``; the ``rng`` for the group's and the
fetches' choices (without one they are fixed; see :class:`StubCluster`); and
:attr:`StubCluster.preemption`, called inside every fetch, where a test may run another
thread's work (see :class:`~.cluster.Preemption`). A member's :meth:`~.cluster.StubMember.io_step`
plays a client's background thread taking its join step between fetches.
"""

from .admin import StubAdmin
from .cluster import Brokers, Preemption, StubGroup, StubMember
from .consumer import DeferringStubSource, StubSource
from .peer import StubCluster
from .publisher import StubShardPublisher

__all__ = [
    "Brokers", "DeferringStubSource", "Preemption", "StubAdmin", "StubCluster", "StubGroup", "StubMember",
    "StubShardPublisher", "StubSource",
]
