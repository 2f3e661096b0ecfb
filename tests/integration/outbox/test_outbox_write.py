"""The outbox's write against SQLAlchemy's own executemany, on generated records and both drivers.

``Outbox.write`` sends a batch's records with COPY when there are many (:mod:`kstore.db.copy`), else
as one multi-row INSERT quoted by the driver (:mod:`kstore.db.manyrows`), the row count checked
either way. The same batches written the plain way (both refused, so SQLAlchemy's own executemany
runs) must leave the same rows: the same ``seq`` per shard, and every record read back by the relay
(``Outbox.pending``) as it was produced.
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
from kstore.types import Produced
from tests.support.harness import with_driver

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


def written(engine: sa.Engine, batches: list[list[Produced]], path: str) -> tuple[Outbox, list[str]]:
    """A fresh group's outbox with ``batches`` written, each in its own transaction, by ``path``
    ("copy", "insert" or "plain"); and the path each batch took."""
    outbox = Outbox(engine, f"w-{uuid.uuid4().hex[:8]}")
    outbox.ensure_shards(SHARDS)
    took: list[str] = []
    real_many, real_copy = outbox_module.execute_many, outbox_module.copy_rows

    def many(*args: Any) -> Any:
        result = real_many(*args) if path == "insert" else None
        took.append("insert" if result is not None else "plain")
        return result

    def copy(*args: Any) -> Any:
        took.append("copy")
        return real_copy(*args)

    with mock.patch.object(outbox_module, "execute_many", many), mock.patch.object(outbox_module, "copy_rows", copy), \
            mock.patch.object(outbox_module, "COPY_FROM_ROWS", 1 if path == "copy" else 10**9):
        for batch in batches:
            with engine.connect() as conn, conn.begin():
                outbox.write(conn, batch)
    return outbox, took


@given(batches=st.lists(st.lists(records, min_size=1, max_size=25), min_size=1, max_size=3))
@example(batches=[[Produced("t", None)], [Produced("t", b"\x00", b"k", (("h", None), ("", b"\xff")), 7)]])
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_multi_row_write_leaves_what_sqlalchemys_own_leaves(engine: sa.Engine,
                                                                batches: list[list[Produced]]) -> None:
    plain, took = written(engine, batches, "plain")
    assert set(took) == {"plain"}
    for path in ("copy", "insert"):
        fast, took = written(engine, batches, path)
        assert set(took) == {path}, f"the outbox's write did not take the {path} path"
        for shard in range(SHARDS):
            expected = [r for batch in batches for r in batch if shard_of(r, SHARDS) == shard]
            got_fast = fast.pending(shard, 0, 10**6)
            got_plain = plain.pending(shard, 0, 10**6)
            assert [(p.seq, p.record) for p in got_fast] == [(p.seq, p.record) for p in got_plain]
            assert [p.record for p in got_fast] == expected
            assert [p.seq for p in got_fast] == list(range(1, len(expected) + 1))
