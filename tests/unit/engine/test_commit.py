"""The commit unit's guards (kstore.engine.commit.CommitUnit), one test each, on SQLite: the offsets'
compare-and-set on the epoch and on the batch's start, the revoke check just before it, and the read
back of a COMMIT whose answer was lost (landed: committed; not landed: run again; a COMMIT still
holding the rows' locks is waited for). Each test fails with its own guard alone taken out.

A lost answer is a real COMMIT on a real database whose result the driver then reports as an error
(or an error before the COMMIT is sent), as a connection cut at that moment does."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.pool import PoolProxiedConnection

from kstore import Settings, migrate
from kstore.db.store import Store, make_engine
from kstore.db.writes import WRITES
from kstore.engine.commit import CommitInDoubt, CommitUnit
from kstore.types import Position
from kstore.types import TopicPartition as TP

GROUP = "g"
T0: TP = ("t", 0)
#: The batch under test: offsets 5..7 of t[0], claimed at epoch 1 (stored offset 5, next 8).
BATCH = {T0: Position(5, 8, 1)}


class Revokes:
    """What the commit unit asks the ledger: the partitions of a batch revoked while it ran."""

    def __init__(self) -> None:
        self.revoked: set[TP] = set()

    def dropped(self, positions: Mapping[TP, Position]) -> set[TP]:
        return self.revoked & set(positions)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    settings = Settings(dsn=f"sqlite:///{tmp_path / 'commit.db'}")
    migrate(settings)
    store = Store(make_engine(settings), settings)
    with store.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (topic TEXT, partition_id INTEGER, kafka_offset INTEGER)"))
    yield store
    store.engine.dispose()


def stored(store: Store, next_offset: int, epoch: int) -> None:
    """The row of t[0] holds ``next_offset`` under ``epoch`` (a claim, a commit or a reset put it there)."""
    o = store.offsets
    with store.engine.begin() as conn:
        conn.execute(o.delete())
        conn.execute(o.insert().values(consumer_group=GROUP, topic=T0[0], partition_id=T0[1], next_offset=next_offset,
                                       epoch=epoch, owner="me", updated_at=datetime.now(timezone.utc)))


def row(store: Store) -> tuple[int | None, int]:
    r = store.rows(GROUP)[T0]
    return r.next_offset, r.epoch


def effects(store: Store) -> list[int]:
    with store.engine.connect() as conn:
        return [o for (o,) in conn.execute(sa.text("SELECT kafka_offset FROM effects ORDER BY kafka_offset"))]


def write_batch(conn: Connection) -> None:
    """The processor's effects for offsets 5..7."""
    conn.execute(sa.text("INSERT INTO effects VALUES ('t', 0, 5), ('t', 0, 6), ('t', 0, 7)"))


def losing_the_answer(store: Store, *, lands: bool) -> None:
    """The next COMMITs on ``store``'s engine report an error: after committing (``lands``: the answer
    was lost) or instead of it (the connection was cut before the server got it)."""
    dialect = store.engine.dialect
    commit = type(dialect).do_commit

    def lossy(dbapi_connection: PoolProxiedConnection) -> None:
        if lands:
            commit(dialect, dbapi_connection)
        else:  # the server never got the COMMIT: the cut connection's transaction is rolled back there
            dbapi_connection.rollback()
        raise sqlite3.OperationalError("server closed the connection unexpectedly")

    dialect.do_commit = lossy  # type: ignore[method-assign]


# -- the compare-and-set --------------------------------------------------------------------------

def test_the_epoch_predicate_fences_a_commit_under_an_epoch_claimed_since(store: Store) -> None:
    """Another worker claimed the partition (epoch 2) at the batch's start: a zombie's commit under
    epoch 1 matches no row, is rolled back whole, and reports the partition fenced."""
    stored(store, 5, epoch=2)
    unit = CommitUnit(store, GROUP, Revokes())
    assert unit.commit(BATCH, write_batch) == {T0}
    assert effects(store) == [], "a fenced batch's effects were committed"
    assert row(store) == (5, 2)


def test_the_position_predicate_fences_a_commit_whose_start_moved(store: Store) -> None:
    """The row holds the batch's end under our epoch (its first COMMIT landed): the batch run again
    under the same epoch matches nothing, so its effects never land twice."""
    stored(store, 8, epoch=1)
    unit = CommitUnit(store, GROUP, Revokes())
    assert unit.commit(BATCH, write_batch) == {T0}
    assert effects(store) == [], "a batch run again after it landed committed its effects a second time"
    assert row(store) == (8, 1)


def test_a_commit_whose_rows_match_lands_with_its_effects(store: Store) -> None:
    """The predicates' companion: with the row at the batch's start under its epoch, it commits."""
    stored(store, 5, epoch=1)
    unit = CommitUnit(store, GROUP, Revokes())
    assert unit.commit(BATCH, write_batch) == set()
    assert effects(store) == [5, 6, 7] and row(store) == (8, 1)


# -- the revoke check ----------------------------------------------------------------------------

def test_a_partition_revoked_while_the_batch_ran_is_not_committed(store: Store) -> None:
    """A rebalance takes the partition while the processor runs, before any new owner claimed it (the
    row still matches): the check before the offsets UPDATE rolls the whole batch back."""
    stored(store, 5, epoch=1)
    ledger = Revokes()
    unit = CommitUnit(store, GROUP, ledger)

    def write_then_revoked(conn: Connection) -> None:
        write_batch(conn)
        ledger.revoked.add(T0)

    assert unit.commit(BATCH, write_then_revoked) == {T0}
    assert effects(store) == [], "a batch of a partition revoked while it ran was committed"
    assert row(store) == (5, 1)


# -- the read back of a lost answer ----------------------------------------------------------------

def test_a_lost_answer_to_a_commit_that_landed_reads_back_as_committed(store: Store) -> None:
    stored(store, 5, epoch=1)
    unit = CommitUnit(store, GROUP, Revokes())
    losing_the_answer(store, lands=True)
    with pytest.raises(CommitInDoubt):
        unit.commit(BATCH, write_batch)
    assert unit.read_back(BATCH) == (True, set()), "a COMMIT that landed was read back as not landed"
    assert effects(store) == [5, 6, 7]


def test_a_lost_answer_to_a_commit_that_did_not_land_reads_back_as_to_run_again(store: Store) -> None:
    stored(store, 5, epoch=1)
    unit = CommitUnit(store, GROUP, Revokes())
    losing_the_answer(store, lands=False)
    with pytest.raises(CommitInDoubt):
        unit.commit(BATCH, write_batch)
    assert unit.read_back(BATCH) == (False, set()), "a COMMIT that did not land was read back as landed"
    assert effects(store) == [] and row(store) == (5, 1)


def test_a_read_back_reports_rows_another_owner_moved_since(store: Store) -> None:
    """Claimed elsewhere since the lost answer: the row tells nothing of the batch, which is fenced."""
    stored(store, 5, epoch=2)
    assert CommitUnit(store, GROUP, Revokes()).read_back(BATCH) == (False, {T0})


def test_the_read_back_waits_for_a_commit_still_holding_the_rows_locks(store: Store) -> None:
    """The lost COMMIT is still being applied when the read back starts (its transaction holds the row):
    the read back waits for it and sees it land, where a plain read would say it did not."""
    stored(store, 5, epoch=1)
    unit = CommitUnit(store, GROUP, Revokes())
    answers: list[tuple[bool, set[TP]]] = []
    with store.engine.connect().execution_options(**WRITES) as committing:
        committing.begin()
        committing.execute(sa.text("UPDATE kstore_offsets SET next_offset = 8"))
        reader = threading.Thread(target=lambda: answers.append(unit.read_back(BATCH)))
        reader.start()
        reader.join(0.5)
        assert not answers, f"the read back answered {answers} while the COMMIT still held the row"
        committing.commit()
    reader.join(10)
    assert answers == [(True, set())]


@pytest.mark.parametrize("lands", [True, False])
def test_a_commit_in_doubt_leaves_a_fresh_connection_for_the_next_batch(store: Store, lands: bool) -> None:
    stored(store, 5, epoch=1)
    unit = CommitUnit(store, GROUP, Revokes())
    first = unit.connection()
    losing_the_answer(store, lands=lands)
    with pytest.raises(CommitInDoubt):
        unit.commit(BATCH, write_batch)
    assert unit.connection() is not first

