"""The outbox's write by its fast paths against its plain path, on generated records and both drivers.

``Outbox.write`` numbers a shard's records with one ``UPDATE ... RETURNING`` per shard and sends
them with COPY when there are many (:mod:`kstore.db.copy`), else as one multi-row INSERT quoted by
the driver (:mod:`kstore.db.manyrows`); a few records of one shard go as one statement (the
numbering, the rows and the NOTIFY in data-modifying CTEs). The row count is checked every way.
The same batches written by the plain path (``Outbox.plain``: ``SELECT ... FOR UPDATE``, an
``UPDATE`` per shard, SQLAlchemy's own executemany) must leave the same rows: every column of
every row (group, shard, seq, topic, partition, key, value, headers), the shards' ``next_seq``, and
every record read back by the relay (``Outbox.pending``) as it was produced.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kstore import Settings
from kstore.db.store import make_engine
from kstore.errors import KstoreError
from kstore.relay import writing as outbox_module
from kstore.relay.lanes import shard_of
from kstore.relay.store import Outbox
from kstore.types import Produced
from tests.support.harness import with_driver

pytestmark = pytest.mark.integration

TRICKY = st.sampled_from(["; -- x", "it's", "%s %(k)s 100%", ":word", "$$", "\\", "ünï 😀", "t.1"])
blobs = st.one_of(st.none(), st.binary(max_size=12), st.just(b"\x00\\'\xff"), st.just(b""))
records = st.builds(
    Produced,
    topic=st.one_of(TRICKY, st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                                    min_size=1, max_size=6)),
    value=blobs,
    key=blobs,
    headers=st.lists(st.tuples(st.text(max_size=4), blobs), max_size=3).map(tuple),
    partition=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
)
#: The fast paths, each forced by the module's thresholds, and the write each batch must then take.
PATHS = {"fused": (10**9, 10**9), "insert": (0, 10**9), "copy": (0, 1)}


@pytest.fixture(params=["psycopg2", "psycopg"])
def engine(request: Any, pg_dsn: str) -> Iterator[sa.Engine]:
    e = make_engine(Settings(dsn=with_driver(pg_dsn, request.param)))
    yield e
    e.dispose()


def written(engine: sa.Engine, batches: list[list[Produced]], shards: int, path: str) -> tuple[Outbox, list[str]]:
    """A fresh group's outbox of ``shards`` shards with ``batches`` written, each in its own
    transaction, by ``path`` ("plain" or one of :data:`PATHS`); and the path each batch took."""
    outbox = Outbox(engine, f"w-{uuid.uuid4().hex[:8]}")
    outbox.ensure_shards(shards)
    outbox.plain = path == "plain"
    took: list[str] = []
    real_many, real_copy, real_fused = outbox_module.execute_many, outbox_module.copy_rows, Outbox._write_fused

    def many(*args: Any) -> Any:
        result = real_many(*args)
        took.append("insert" if result is not None else "plain")
        return result

    def copy(*args: Any) -> Any:
        took.append("copy")
        return real_copy(*args)

    def fused(*args: Any) -> Any:
        took.append("fused")
        return real_fused(*args)

    fused_max, copy_from = PATHS.get(path, (0, 10**9))
    with mock.patch.object(outbox_module, "execute_many", many), mock.patch.object(outbox_module, "copy_rows", copy), \
            mock.patch.object(Outbox, "_write_fused", fused), \
            mock.patch.object(outbox_module, "FUSED_MAX_ROWS", fused_max), \
            mock.patch.object(outbox_module, "COPY_FROM_ROWS", copy_from):
        for batch in batches:
            with engine.connect() as conn, conn.begin():
                outbox.write(conn, batch)
    if path == "plain":
        took = ["plain"] * len(batches)
    return outbox, took


def rows_of(outbox: Outbox) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]]]:
    """Every row the outbox's group has (its group's name left out) and its shards' ``next_seq``."""
    t = outbox.tables
    o, s = t.outbox, t.shards
    with outbox.engine.connect() as conn:
        rows = conn.execute(
            sa.select(o.c.shard, o.c.seq, o.c.topic, o.c.partition_id, o.c.key, o.c.value, o.c.headers)
            .where(o.c.consumer_group == outbox.group).order_by(o.c.shard, o.c.seq)).all()
        seqs = conn.execute(sa.select(s.c.shard, s.c.next_seq).where(s.c.consumer_group == outbox.group)
                            .order_by(s.c.shard)).all()
    return ([(r[0], r[1], r[2], r[3], None if r[4] is None else bytes(r[4]), None if r[5] is None else bytes(r[5]),
              r[6]) for r in rows], [tuple(r) for r in seqs])


@given(batches=st.lists(st.lists(records, min_size=1, max_size=25), min_size=1, max_size=3),
       shards=st.sampled_from([1, 3]))
@example(batches=[[Produced("t", None)], [Produced("t", b"\x00", b"k", (("h", None), ("", b"\xff")), 7)]], shards=3)
@example(batches=[[Produced("t", None, None, (), None)] * 3], shards=1)
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_fast_writes_leave_what_the_plain_write_leaves(engine: sa.Engine, batches: list[list[Produced]],
                                                           shards: int) -> None:
    plain, _ = written(engine, batches, shards, "plain")
    plain_rows, plain_seqs = rows_of(plain)
    assert len(plain_rows) == sum(map(len, batches))
    for path in PATHS:
        fast, took = written(engine, batches, shards, path)
        expected_paths = [path if path != "fused" or len({shard_of(r, shards) for r in batch}) == 1 else "insert"
                          for batch in batches]
        assert took == expected_paths, f"the outbox's write did not take the {path} path"
        assert rows_of(fast) == (plain_rows, plain_seqs), f"the {path} write left other rows than the plain one"
        for shard in range(shards):
            expected = [r for batch in batches for r in batch if shard_of(r, shards) == shard]
            got = fast.pending({shard: 0}, 10**6)
            assert [p.record for p in got] == expected
            assert [p.seq for p in got] == list(range(1, len(expected) + 1))


@pytest.mark.parametrize("path", ["plain", *PATHS])
def test_a_write_to_a_shard_that_is_missing_fails_and_writes_nothing(engine: sa.Engine, path: str) -> None:
    outbox, _ = written(engine, [], 2, path)
    with engine.begin() as conn:
        conn.execute(sa.delete(outbox.tables.shards).where(outbox.tables.shards.c.consumer_group == outbox.group,
                                                           outbox.tables.shards.c.shard == 1))
    record = next(Produced("t", b"v", key) for key in (bytes([i]) for i in range(256)) if shard_of(
        Produced("t", b"v", key), 2) == 1)
    fused_max, copy_from = PATHS.get(path, (0, 10**9))
    outbox.plain = path == "plain"
    with mock.patch.object(outbox_module, "FUSED_MAX_ROWS", fused_max), \
            mock.patch.object(outbox_module, "COPY_FROM_ROWS", copy_from), \
            pytest.raises(KstoreError, match=r"shards .* are missing: \[1\]"), engine.begin() as conn:
        outbox.write(conn, [record])
    assert rows_of(outbox)[0] == []
