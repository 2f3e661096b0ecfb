"""The peers behind kstore's seam (:mod:`kstore.kafka.seam`), each behind one small adapter the
contract tests use alike: make a topic, produce records, and make a source, an admin reader or a
publisher factory as :mod:`kstore.kafka.clients` would.

- :class:`RealPeer`: confluent-kafka or kafka-python on the real broker the harness starts
  (tests/conftest.py's ``kafka``); the records are produced with kafka-python's producer.
- :class:`StubPeer`: the in-memory stub (:mod:`kstore.kafka.stub`) on a ``StubCluster`` of its own.

:class:`Member` drives one source as the engine does (a fetch loop, the rebalance events it posts)
and keeps what it saw; nothing in it knows which peer it drives.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kafka import TopicPartition

from kstore.kafka import clients
from kstore.kafka.seam import AdminReader, ConsumerSource, EventKind, Fetched, Refused
from kstore.relay.publisher import PublisherFactory, ShardPublisher
from kstore.settings import Settings
from kstore.types import Record
from kstore.types import TopicPartition as TP

#: How long a condition the peers reach by themselves (a join, a rebalance, a fetch) may take.
WAIT_S = 30.0
#: One fetch's wait: short, so a loop over two members serves both often.
FETCH_MS = 100


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Peer:
    """What a contract test asks of a peer. Everything it makes is closed by :meth:`close`."""

    name: str

    def __init__(self) -> None:
        self._made: list[Callable[[], None]] = []

    def topic(self, partitions: int = 4) -> str:
        """A new topic with that many partitions, its leaders elected."""
        raise NotImplementedError

    def produce(self, topic: str, partition: int, values: Iterable[bytes | None], *, key: bytes | None = None,
                timestamps_ms: Sequence[int] | None = None) -> list[int]:
        """Write ``values`` to one partition, in order, and wait for them: their offsets."""
        raise NotImplementedError

    def delete_records(self, topic: str, partition: int, before: int) -> None:
        """Move the partition's log start up to ``before`` (retention, ``kafka-delete-records``)."""
        raise NotImplementedError

    def settings(self) -> Settings:
        raise NotImplementedError

    def _source(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> ConsumerSource:
        raise NotImplementedError

    def _admin(self, settings: Settings) -> AdminReader:
        raise NotImplementedError

    def publisher_factory(self) -> PublisherFactory:
        """What makes the relay's transport for a lane: ``(settings, transactional_id, max_record_bytes)``."""
        raise NotImplementedError

    def publisher(self, transactional_id: str, max_record_bytes: int = 1_000_000) -> ShardPublisher:
        """A lane's transport (fencing the lane's earlier one), closed at the end."""
        made = self.publisher_factory()(self.settings(), transactional_id, max_record_bytes)
        self._made.append(made.close)
        return made

    def source(self, group: str, topics: Sequence[str], worker_id: str | None = None) -> ConsumerSource:
        """A worker's consumer of ``topics`` in ``group`` (not subscribed yet), closed at the end."""
        made = self._source(self.settings(), group, list(topics), worker_id or unique("w"))
        self._made.append(made.close)
        return made

    def admin(self) -> AdminReader:
        made = self._admin(self.settings())
        self._made.append(made.close)
        return made

    def close(self) -> None:
        for close in reversed(self._made):
            # A client the test closed already (a member that left) may refuse a second close.
            with contextlib.suppress(Exception):
                close()
        self._made.clear()


class RealPeer(Peer):
    """One of the two real clients (``confluent`` or ``kafka-python``) on the harness's broker."""

    def __init__(self, client: str, bootstrap: str, admin_client: Any, producer: Any,
                 new_topic: Callable[..., str]) -> None:
        super().__init__()
        self.name = client
        self._bootstrap = bootstrap
        self._kadmin = admin_client
        self._producer = producer
        self._new_topic = new_topic

    def topic(self, partitions: int = 4) -> str:
        return self._new_topic(partitions)

    def produce(self, topic: str, partition: int, values: Iterable[bytes | None], *, key: bytes | None = None,
                timestamps_ms: Sequence[int] | None = None) -> list[int]:
        values = list(values)
        stamps: Sequence[int | None] = timestamps_ms if timestamps_ms is not None else [None] * len(values)
        futures = [self._producer.send(topic, value=v, key=key, partition=partition, timestamp_ms=t)
                   for v, t in zip(values, stamps, strict=True)]
        self._producer.flush()
        return [f.get(timeout=30).offset for f in futures]

    def delete_records(self, topic: str, partition: int, before: int) -> None:
        self._kadmin.delete_records({TopicPartition(topic, partition): before})

    def settings(self) -> Settings:
        # A short session, as the integration tests' workers use: a member that leaves without a word moves on soon.
        return Settings(bootstrap_servers=self._bootstrap, kafka_client=self.name, session_timeout_ms=6000,
                        heartbeat_interval_ms=1000, connect_timeout_s=20)

    def _source(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> ConsumerSource:
        return clients.source_class(settings)(settings, group, topics, worker_id)

    def _admin(self, settings: Settings) -> AdminReader:
        return clients.admin_reader(settings)

    def publisher_factory(self) -> PublisherFactory:
        return clients.publisher_class(self.name)


class StubPeer(Peer):
    """The in-memory stub, on a cluster of its own."""

    name = "stub"

    def __init__(self) -> None:
        super().__init__()
        from kstore.kafka import stub

        self.cluster = stub.StubCluster()

    def topic(self, partitions: int = 4) -> str:
        name = unique("t")
        self.cluster.create_topic(name, partitions)
        return name

    def produce(self, topic: str, partition: int, values: Iterable[bytes | None], *, key: bytes | None = None,
                timestamps_ms: Sequence[int] | None = None) -> list[int]:
        values = list(values)
        stamps: Sequence[int | None] = timestamps_ms if timestamps_ms is not None else [None] * len(values)
        return [self.cluster.produce(topic, partition, v, key=key, timestamp_ms=t)
                for v, t in zip(values, stamps, strict=True)]

    def delete_records(self, topic: str, partition: int, before: int) -> None:
        self.cluster.delete_records(topic, partition, before)

    def settings(self) -> Settings:
        return Settings(session_timeout_ms=6000, heartbeat_interval_ms=1000, connect_timeout_s=20)

    def _source(self, settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> ConsumerSource:
        return self.cluster.source(settings, group, topics, worker_id)

    def _admin(self, settings: Settings) -> AdminReader:
        return self.cluster.admin(settings)

    def publisher_factory(self) -> PublisherFactory:
        return self.cluster.publisher


class Member:
    """One source driven as the engine drives it: subscribed with a callback that records each
    rebalance event, fetched in a loop, every record and refusal kept by partition."""

    def __init__(self, source: ConsumerSource) -> None:
        self.source = source
        self.events: list[tuple[EventKind, list[TP]]] = []
        self.records: dict[TP, list[Record]] = defaultdict(list)
        self.refused: list[Refused] = []
        #: Records that came for a partition no "assigned" event had named yet (must stay empty).
        self.unannounced: list[Record] = []

    def subscribe(self) -> Member:
        self.source.subscribe(self._post)
        return self

    def _post(self, kind: EventKind, tps: list[TP]) -> None:
        self.events.append((kind, sorted(tps)))

    def given(self) -> set[TP]:
        """The assignment the events tell, applied in order: what the engine believes it was given."""
        held: set[TP] = set()
        for kind, tps in self.events:
            if kind == "assigned":
                held |= set(tps)
            else:
                held -= set(tps)
        return held

    def named(self, kind: EventKind) -> set[TP]:
        """Every partition an event of ``kind`` named."""
        return {tp for k, tps in self.events if k == kind for tp in tps}

    def fetch(self, timeout_ms: int = FETCH_MS, max_records: int = 500) -> Fetched:
        announced = self.named("assigned")
        fetched = self.source.fetch(timeout_ms, max_records)
        for tp, records in fetched.records:
            if tp not in announced and tp not in self.named("assigned"):
                self.unannounced.extend(records)
            self.records[tp].extend(records)
        self.refused.extend(fetched.refused)
        return fetched

    def offsets(self, tp: TP) -> list[int]:
        return [r.offset for r in self.records[tp]]

    def values(self, tp: TP) -> list[Any]:
        return [r.value for r in self.records[tp]]

    def own(self, tps: Iterable[TP], offset: int) -> None:
        """What the engine does once a claim answered: seek each partition to its stored offset, resume it."""
        tps = list(tps)
        for tp in tps:
            self.source.seek(tp, offset)
        self.source.resume(tps)

    def close(self) -> None:
        self.source.close()


def fetch_until(members: Sequence[Member], done: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Fetch with every member in turn (a rebalance needs each of them polling) until ``done()`` is
    truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for member in members:
            member.fetch()
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}; events: "
                                 + "; ".join(f"{m.source.worker_id}: {m.events}" for m in members))


def fetch_for(members: Sequence[Member], seconds: float) -> None:
    """Keep fetching for ``seconds``: a peer that would deliver something it must not has had its chance."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for member in members:
            member.fetch()


def wait_for(done: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Ask ``done()`` until it is truthy (a broker's answer that settles by itself)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.05)
