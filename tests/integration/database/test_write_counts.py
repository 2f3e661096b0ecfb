"""Every write kstore rewrites for speed has its row count checked (real PostgreSQL, both drivers).

A table whose BEFORE INSERT trigger returns NULL drops rows on purpose: the server then
reports fewer rows than kstore sent, which kstore cannot tell from rows lost on the way, so
the batch fails with WriteCountError before its commit. Such a table is written with
``defer_inserts = False`` (one statement per row, nothing to check), as documented.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.session import batch_session
from kstore.db.store import make_engine
from kstore.errors import KstoreError, WriteCountError
from tests.support.harness import with_driver

metadata = sa.MetaData()
dropping = sa.Table("dropping", metadata, sa.Column("id", sa.Integer, primary_key=True), sa.Column("n", sa.Integer))
TRIGGER = [
    "CREATE FUNCTION drop_odd() RETURNS trigger LANGUAGE plpgsql AS $$"
    " BEGIN IF mod(NEW.n, 2) = 1 THEN RETURN NULL; END IF; RETURN NEW; END $$",
    "CREATE TRIGGER drop_odd BEFORE INSERT ON dropping FOR EACH ROW EXECUTE FUNCTION drop_odd()",
]


@pytest.fixture(params=["psycopg2", "psycopg"])
def engine(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[sa.Engine]:
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, request.param)))
    metadata.create_all(eng)
    with eng.begin() as conn:
        for sql in TRIGGER:
            conn.exec_driver_sql(sql)
    yield eng
    eng.dispose()


def count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(dropping)).scalar_one())


@pytest.mark.parametrize("write", [
    pytest.param(lambda s, rows: [s.execute(dropping.insert(), r) for r in rows], id="deferred Core INSERTs"),
    pytest.param(lambda s, rows: [s.execute(sa.text("INSERT INTO dropping (n) VALUES (:n) -- n"), r) for r in rows],
                 id="deferred text() INSERTs"),
    pytest.param(lambda s, rows: s.execute(dropping.insert(), rows), id="an executemany"),
    pytest.param(lambda s, rows: s.copy_rows(dropping, rows), id="copy_rows"),
])
def test_fewer_rows_than_sent_fail_the_batch(engine: sa.Engine, write: object) -> None:
    rows = [{"n": n} for n in range(10)]
    with engine.connect() as conn, conn.begin():
        with pytest.raises(WriteCountError, match=r"of 10 rows .* reported 5 rows") as failed, \
                batch_session(conn) as session:
            write(session, rows)  # type: ignore[operator]
            session.flush()
        assert isinstance(failed.value, KstoreError) and "defer_inserts = False" in str(failed.value)
        conn.rollback()
    assert count(engine) == 0


def test_without_deferral_such_a_table_is_written_row_by_row(engine: sa.Engine) -> None:
    with engine.connect() as conn, conn.begin(), batch_session(conn, defer_inserts=False) as session:
        for n in range(10):
            session.execute(dropping.insert(), {"n": n})
    assert count(engine) == 5
