"""Races between the worker's threads, replayed deterministically: the real Ledger,
KafkaPythonSource, Partitions and Store (on SQLite), a stub consumer, and the interleaving forced by
running the fetch thread's part inside a read of the main thread's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import TopicPartition
from kafka.structs import OffsetAndTimestamp
from sqlalchemy.exc import OperationalError

from kstore import Processor, Settings, migrate
from kstore.db.store import Store, make_engine
from kstore.engine.backoff import Backoff
from kstore.engine.batches import Batches
from kstore.engine.ownership import Ledger
from kstore.engine.partitions import Owned, Partitions
from kstore.kafka.kafkapython.consumer import KafkaPythonSource

TOPIC = "races"
TP = (TOPIC, 0)


@dataclass(frozen=True)
class Rec:
    topic: str
    partition: int
    offset: int
    timestamp: int = 0
    key: bytes | None = None
    value: bytes | None = b"v"
    headers: tuple[tuple[str, bytes | None], ...] = ()
    serialized_key_size: int = -1
    serialized_value_size: int = 1


class StubConsumer:
    """What KafkaPythonSource and Ledger call, with kafka-python 3's refusals for unassigned partitions."""

    def __init__(self) -> None:
        self.assigned: set[tuple[str, int]] = set()
        self.positions: dict[tuple[str, int], int] = {}
        self.log_start = 0

    def _check(self, ktp: TopicPartition, error: type[Exception]) -> tuple[str, int]:
        tp = (ktp.topic, ktp.partition)
        if tp not in self.assigned:
            raise error("Unassigned partition")
        return tp

    def seek(self, ktp: TopicPartition, offset: int) -> None:
        self.positions[self._check(ktp, ValueError)] = offset

    def pause(self, *ktps: TopicPartition) -> None:
        for ktp in ktps:
            self._check(ktp, KeyError)

    def resume(self, *ktps: TopicPartition) -> None:
        for ktp in ktps:
            self._check(ktp, KeyError)

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(*tp) for tp in self.assigned}

    def beginning_offsets(self, ktps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {k: self.log_start for k in ktps}

    def end_offsets(self, ktps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {k: 1000 for k in ktps}

    def offsets_for_times(self, query: dict[TopicPartition, int]) -> dict[TopicPartition, Any]:
        return {k: OffsetAndTimestamp(70, ms, -1) for k, ms in query.items()}

    def close(self, autocommit: bool = False) -> None:
        pass


class StubSource(KafkaPythonSource):
    def _connect(self) -> Any:
        return StubConsumer()


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Store, StubSource, Ledger]:
    settings = Settings(dsn=f"sqlite:///{tmp_path / 'races.db'}")
    migrate(settings)
    store = Store(make_engine(settings), settings)
    source = StubSource(settings, "g", [TOPIC], "me")
    ledger = Ledger(settings, "g", "me", store, source, Partitions(settings, source))
    source.consumer.assigned.add(TP)
    ledger.assign([TP])
    assert ledger.claim_pending() == [TP]
    return store, source, ledger


def test_a_revoke_during_the_recheck_of_an_operators_reset_delivers_no_stale_record(
        parts: tuple[Store, StubSource, Ledger]) -> None:
    """A batch of offsets 0..4 is in flight; an operator resets the partition to 100.
    While the worker re-reads the row (without the lock), an eager rebalance revokes the
    partition and assigns it again. The old code placed it anyway, in a new queue whose
    generation restarted at 1, so the in-flight batch's requeue matched and offsets 0..4 sat
    at the head of a queue sought to 100: delivered and committed, they undid the reset."""
    store, _source, ledger = parts
    with ledger.lock:
        ledger.partitions._enqueue(ledger.partitions.queues()[TP], [Rec(TOPIC, 0, o) for o in range(10)])
        records, _ends, _counts = ledger.partitions.take_batch(5)
        generations = {TP: ledger.partitions.generation(TP) or 0}
    store.reset("g", TP, 100, expected_epoch=None, reason="operator")

    read_rows = store.rows

    def rows_then_rebalance(*args: Any, **kwargs: Any) -> Any:
        rows = read_rows(*args, **kwargs)
        # The fetch thread's turn, between the read and the decision: revoked, then assigned again.
        ledger.drop([TP])
        with ledger.lock:
            ledger.assign([TP])
        return rows

    store.rows = rows_then_rebalance  # type: ignore[method-assign]
    ledger.recheck([TP])
    ledger.partitions.requeue(records, generations)

    with ledger.lock:
        queued, _, _ = ledger.partitions.take_batch(100)
    stale = [r.offset for r in queued if r.offset < 100]
    assert not stale, f"records from before the reset would be delivered after it: {stale}"
    assert TP in ledger.pending, "the partition must be claimed again, not placed by the recheck"


def test_generations_are_never_reused_for_a_partition(parts: tuple[Store, StubSource, Ledger]) -> None:
    """The invariant behind the fix: a queue made after a flush never shares a generation with
    one before it, even when the partition was dropped and owned again in between."""
    _store, _source, ledger = parts
    seen = [ledger.partitions.generation(TP)]
    for offset in range(5):
        ledger.drop([TP])
        with ledger.lock:
            ledger.assign([TP])
            ledger.partitions.own(TP, Owned(1, offset), offset)
        seen.append(ledger.partitions.generation(TP))
    assert len(set(seen)) == len(seen), seen


def test_an_operators_reset_fenced_by_another_claim_while_adopted_drops_the_partition(
        parts: tuple[Store, StubSource, Ledger]) -> None:
    """An operator reset below the log start is adopted by storing the start policy's
    offset under the row's epoch; another worker claiming the row in between made that write
    raise FencedError, which nothing caught: the worker exited."""
    store, source, ledger = parts
    source.consumer.log_start = 50
    store.reset("g", TP, 10, expected_epoch=None, reason="operator")
    read_rows = store.rows

    def rows_then_claimed_elsewhere(*args: Any, **kwargs: Any) -> Any:
        rows = read_rows(*args, **kwargs)
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE kstore_offsets SET epoch = epoch + 1, owner = 'other'"))
        return rows

    store.rows = rows_then_claimed_elsewhere  # type: ignore[method-assign]
    adopted, _dropped = ledger.recheck([TP])
    assert adopted == [] and TP not in ledger.owned and ledger.partitions.generation(TP) is None
    assert TP in ledger.fenced_at, "a partition Kafka still assigns here must be claimed again later"


def test_a_fenced_partition_whose_row_cannot_be_read_now_stays_owned(parts: tuple[Store, StubSource, Ledger]) -> None:
    """When re-reading a fenced partition's row fails (database away), the partition is not dropped
    and paused unmarked (nobody would consume it again): it stays as it is (its next commit is
    fenced again) and the database backoff retries."""
    store, source, ledger = parts

    def recheck(_tps: list[tuple[str, int]]) -> None:
        raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))

    batches = Batches(Processor(), ledger.settings, "g", store, source, ledger, Backoff(0.5, 10), recheck)
    with ledger.lock:
        positions = ledger.positions({TP: 5})
    batches._on_fenced({TP}, positions)
    assert TP in ledger.owned and ledger.partitions.generation(TP) is not None
    assert not batches.db_backoff.ready(), "the database error must hold off the next attempt"


def test_an_operators_reset_below_the_log_start_adopts_a_time_start_policy_at_its_time(tmp_path: Path) -> None:
    """With ``start_from`` a time, a reset below the log start (retention) must start at the first
    record at or after that time, as a claim does, not at the log end."""
    settings = Settings(dsn=f"sqlite:///{tmp_path / 'policy.db'}", start_from="2026-01-01T00:00:00+00:00")
    migrate(settings)
    store = Store(make_engine(settings), settings)
    source = StubSource(settings, "g", [TOPIC], "me")
    ledger = Ledger(settings, "g", "me", store, source, Partitions(settings, source))
    source.consumer.assigned.add(TP)
    ledger.assign([TP])
    ledger.claim_pending()
    assert ledger.offsets() == {TP: 70}
    source.consumer.log_start = 50
    store.reset("g", TP, 10, expected_epoch=None, reason="operator")
    assert ledger.recheck([TP])[0] == [TP]
    assert ledger.offsets() == {TP: 70} and source.consumer.positions[TP] == 70


def test_a_partition_assigned_again_without_a_revoke_is_flushed_and_claimed_again(
        parts: tuple[Store, StubSource, Ledger]) -> None:
    """An "assigned" event for a partition this worker still delivers (no revoke came between: a
    client's bug or a lost callback) neither stops the worker nor leaves it delivering: the partition
    is flushed and claimed again under a new epoch before any record of it is delivered."""
    _store, _source, ledger = parts
    epoch = ledger.owned[TP].epoch
    generation = ledger.partitions.generation(TP)
    ledger.assign([TP])
    assert TP in ledger.pending and TP not in ledger.owned and ledger.partitions.generation(TP) is None
    assert ledger.claim_pending() == [TP]
    assert ledger.owned[TP].epoch == epoch + 1 and ledger.partitions.generation(TP) != generation
