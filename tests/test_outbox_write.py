"""The outbox's write against SQLAlchemy's own executemany, on generated records and both drivers.

``Outbox.write`` sends a batch's records as one multi-row INSERT quoted by the driver
(:mod:`kstore.db.manyrows`), its row count checked. The same batches written the plain way (the
fast path refused, so SQLAlchemy's own executemany runs) must leave the same rows: the same
``seq`` per shard, and every record read back by the relay (``Outbox.pending``) as it was produced.
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
from kstore.db import outbox as outbox_module
from kstore.db.outbox import Outbox, shard_of
from kstore.db.store import make_engine
from kstore.records import Produced

from .harness import with_driver

pytestmark = pytest.mark.integration

SHARDS = 3
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


@pytest.fixture(params=["psycopg2", "psycopg"])
def engine(request: Any, pg_dsn: str) -> Iterator[sa.Engine]:
    e = make_engine(Settings(dsn=with_driver(pg_dsn, request.param)))
    yield e
    e.dispose()


def written(engine: sa.Engine, batches: list[list[Produced]], fast: bool) -> tuple[Outbox, list[bool]]:
    """A fresh group's outbox with ``batches`` written, each in its own transaction; and, per
    batch, whether the multi-row INSERT ran (False: SQLAlchemy's own executemany did)."""
    outbox = Outbox(engine, f"w-{uuid.uuid4().hex[:8]}")
    outbox.ensure_shards(SHARDS)
    took: list[bool] = []
    real = outbox_module.execute_many

    def spy(*args: Any) -> Any:
        result = real(*args) if fast else None
        took.append(result is not None)
        return result

    with mock.patch.object(outbox_module, "execute_many", spy):
        for batch in batches:
            with engine.connect() as conn, conn.begin():
                outbox.write(conn, batch)
    return outbox, took


@given(batches=st.lists(st.lists(records, min_size=1, max_size=25), min_size=1, max_size=3))
@example(batches=[[Produced("t", None)], [Produced("t", b"\x00", b"k", (("h", None), ("", b"\xff")), 7)]])
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_multi_row_write_leaves_what_sqlalchemys_own_leaves(engine: sa.Engine,
                                                                batches: list[list[Produced]]) -> None:
    fast, took = written(engine, batches, fast=True)
    plain, _ = written(engine, batches, fast=False)
    assert all(took), "the outbox's write did not take the multi-row INSERT"
    for shard in range(SHARDS):
        expected = [r for batch in batches for r in batch if shard_of(r, SHARDS) == shard]
        got_fast = fast.pending(shard, 0, 10**6)
        got_plain = plain.pending(shard, 0, 10**6)
        assert [(p.seq, p.record) for p in got_fast] == [(p.seq, p.record) for p in got_plain]
        assert [p.record for p in got_fast] == expected
        assert [p.seq for p in got_fast] == list(range(1, len(expected) + 1))
