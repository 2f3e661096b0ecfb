"""kstore's one-round-trip commit on PostgreSQL through psycopg2 (kstore/db/store.py).

The batch connection runs in psycopg2's autocommit mode with kstore's own BEGIN, and a batch
ends with "<compare-and-set>; COMMIT" in one message. Checked on the wire (the fault proxy reads
every message a worker sends), and at its edges: a fenced compare-and-set commits nothing, and no
connection goes back to the pool inside a transaction kstore began. The commit in doubt is
tests/integration/faults_and_in_doubt/test_worker_in_doubt.py's (the proxy cuts this message's answer there).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg2.extensions
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from kstore import Settings
from kstore.db.dbapi import BEGIN_BATCH
from kstore.db.store import FencedCommit, Store, TransactionEnded, make_engine
from tests.support.faultproxy import FaultProxy
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until, with_driver
from tests.support.processors import effects as effects_table


def is_one_trip_commit(sql: str) -> bool:
    return sql.startswith("WITH moved AS (UPDATE") and sql.rstrip().endswith("; COMMIT")


def test_a_batch_is_its_writes_and_one_commit_message_on_the_wire(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    """Every batch of a real worker is two messages on its connection: the batch's multi-row
    INSERT with kstore's BEGIN in front of it (sent only then, so the processor's time before
    it is never idle in transaction), and the compare-and-set with its COMMIT; never a BEGIN,
    a COMMIT or an offset UPDATE of their own. And every message lands once."""
    url = make_url(pg_dsn)
    topic = new_topic(2)
    expected = set(produce(topic, [f"m{i}" for i in range(400)]))
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        w = workers(with_driver(proxy.dsn_through(pg_dsn), "psycopg2"), topic, "onetrip",
                    env={"KSTORE_MAX_BATCH_SIZE": "50"})
        wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 60, what="every message processed")
        assert w.terminate() == 0
        queries = list(proxy.queries)
    assert_exactly_once(effects(pg_dsn), expected)
    assert sum(stored_offsets(pg_dsn, "onetrip").values()) == len(expected)  # type: ignore[arg-type]

    batch_conns = {cid for cid, sql in queries if is_one_trip_commit(sql)}
    assert len(batch_conns) == 1, batch_conns
    sent = [sql for cid, sql in queries if cid in batch_conns]
    commits = [i for i, sql in enumerate(sent) if is_one_trip_commit(sql)]
    assert len(commits) >= len(expected) // 50
    previous = commits[0] - 1  # before it: a claim may have used the connection
    for end in commits:
        batch = sent[previous:end + 1]
        assert len(batch) == 2, batch
        assert batch[0].startswith(f"{BEGIN_BATCH}; INSERT INTO"), batch
        assert batch[1].startswith("WITH moved AS (UPDATE"), batch
        previous = end + 1
    assert not any(sql.strip().upper() in ("COMMIT", "ROLLBACK") for sql in sent[commits[0]:commits[-1]])


@pytest.fixture
def store(pg_dsn: str) -> Iterator[Store]:
    settings = Settings(dsn=with_driver(pg_dsn, "psycopg2"))
    engine = make_engine(settings)
    yield Store(engine, settings)
    engine.dispose()


def claim(store: Store, group: str, tps: list[tuple[str, int]], owner: str) -> dict[tuple[str, int], int]:
    """Claim ``tps`` for ``owner``, starting at offset 0; their epochs."""
    with store.claiming(group, tps, owner) as (conn, claims):
        for tp, c in claims.items():
            if c.next_offset is None:
                store.start_at(conn, group, tp, 0, c.epoch, "test", None)
        return {tp: c.epoch for tp, c in claims.items()}


def batch(store: Store, group: str, positions: dict[tuple[str, int], tuple[int, int, int]], value: str) -> None:
    """What a worker's batch does: BEGIN of its own in autocommit mode, a write, the one-trip commit."""
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(BEGIN_BATCH)
        conn.execute(effects_table.insert(), {"topic": "t", "partition_id": 0, "kafka_offset": 0, "value": value,
                                              "worker": "w"})
        store.commit_in_one_round_trip(conn, group, positions)


def values(dsn: str) -> list[str]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(effects_table.c.value).order_by(effects_table.c.value)).scalars())
    finally:
        engine.dispose()


def test_a_fenced_partition_commits_nothing_of_the_batch(store: Store, pg_dsn: str) -> None:
    """Two partitions in one batch, one claimed meanwhile by another worker: the compare-and-set
    raises in the server before COMMIT, so neither the batch's write nor the other partition's
    offset lands. With both epochs current, both land in the same message."""
    tps = [("t", 0), ("t", 1)]
    mine = claim(store, "g", tps, "me")
    theirs = claim(store, "g", [("t", 1)], "other")
    assert theirs[("t", 1)] > mine[("t", 1)]

    with pytest.raises(FencedCommit):
        batch(store, "g", {tp: (0, 5, mine[tp]) for tp in tps}, "fenced")
    assert values(pg_dsn) == []
    assert stored_offsets(pg_dsn, "g") == {("t", 0): 0, ("t", 1): 0}

    now = {("t", 0): mine[("t", 0)], ("t", 1): theirs[("t", 1)]}
    batch(store, "g", {tp: (0, 5, now[tp]) for tp in tps}, "landed")
    assert values(pg_dsn) == ["landed"]
    assert stored_offsets(pg_dsn, "g") == {("t", 0): 5, ("t", 1): 5}
    # The compare-and-set also holds the start: the same batch again (a retry after a lost
    # answer, say) is fenced and lands nothing.
    with pytest.raises(FencedCommit):
        batch(store, "g", {tp: (0, 5, now[tp]) for tp in tps}, "again")
    assert values(pg_dsn) == ["landed"]


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK", "COMMIT; BEGIN", "ROLLBACK; BEGIN"])
def test_a_batch_whose_transaction_the_processor_ended_commits_no_offsets(store: Store, pg_dsn: str,
                                                                         end: str) -> None:
    """A processor (or a library it calls) that sends COMMIT or ROLLBACK through SQL mid-batch ends
    kstore's transaction: the one-trip commit then raises TransactionEnded in the server, before its
    COMMIT, and the offsets stay where they were, even when a new transaction was begun after it."""
    (tp,) = tps = [("t", 0)]
    mine = claim(store, "g", tps, "me")
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(BEGIN_BATCH)
        conn.execute(effects_table.insert(), {"topic": "t", "partition_id": 0, "kafka_offset": 0, "value": "before",
                                              "worker": "w"})
        conn.exec_driver_sql(end)
        with pytest.raises(TransactionEnded):
            store.commit_in_one_round_trip(conn, "g", {tp: (0, 5, mine[tp])})
    assert stored_offsets(pg_dsn, "g") == {tp: 0}
    # What the processor committed itself landed (and cannot be undone: the worker stops).
    assert values(pg_dsn) == (["before"] if end.startswith("COMMIT") else [])


def test_no_connection_goes_back_to_the_pool_inside_kstores_own_transaction(store: Store, pg_dsn: str) -> None:
    """A batch connection closed between its BEGIN and its commit (a processor failed, a signal)
    returns to the pool; psycopg2 knows nothing of that transaction, so without kstore's reset it
    would stay open and the next user of the connection would commit the half-done batch."""
    engine = store.engine
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        first = conn.connection.dbapi_connection
        conn.exec_driver_sql("BEGIN")
        conn.execute(effects_table.insert(), {"topic": "t", "partition_id": 0, "kafka_offset": 0, "value": "half",
                                              "worker": "w"})
    with engine.connect() as conn:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is first  # the same connection, back from the pool
        assert dbapi is not None
        assert dbapi.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        conn.execute(effects_table.insert(), {"topic": "t", "partition_id": 0, "kafka_offset": 1, "value": "next",
                                              "worker": "w"})
        conn.commit()
    assert values(pg_dsn) == ["next"]
