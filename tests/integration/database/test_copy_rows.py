"""``session.copy_rows``: PostgreSQL's COPY inside the batch's transaction (kstore/db/copy.py).

Every value type it promises, read back as written, on psycopg2 (kstore's own COPY
text encoding) and psycopg 3 (the driver's copy), and on SQLite (a multi-row INSERT);
its place in the batch's order and transaction; and, with a worker against real
Kafka, a row the database refuses in the middle of a COPY: the batch fails whole, the
message is found and dead-lettered, and every other message lands exactly once.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Iterator
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from kstore import Settings
from kstore.db.copy import COPY_PIECE_ROWS
from kstore.db.session import batch_session
from kstore.db.sqlerrors import transient
from kstore.db.store import make_engine
from tests.integration.failures_and_dead_letters.test_failures import dead_letter_rows
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until, with_driver

metadata = sa.MetaData()
kinds = sa.Table(
    "kinds", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("i", sa.BigInteger), sa.Column("f", sa.Float), sa.Column("d", sa.Numeric(20, 6)),
    sa.Column("s", sa.Text), sa.Column("b", sa.LargeBinary), sa.Column("ok", sa.Boolean),
    sa.Column("at", sa.DateTime(timezone=True)), sa.Column("day", sa.Date), sa.Column("clock", sa.Time),
    sa.Column("u", sa.Uuid), sa.Column("doc", sa.JSON),
)
pg_only = sa.Table("pg_only", sa.MetaData(), sa.Column("span", sa.Interval), sa.Column("doc", pg.JSONB))

#: Values chosen to break a naive encoding: COPY's separators and escapes, NUL bytes, unicode, NULLs.
TRICKY = "tab\there, newline\nthere, return\r, backslash \\ and \\N, quote ' \" ; %s %(x)s, ünï 😀"
ROWS = [
    {"i": 2**62, "f": 1.5e-7, "d": Decimal("-12345.678901"), "s": TRICKY, "b": bytes(range(256)), "ok": True,
     "at": datetime(2026, 12, 1, 11, 30, 15, 123456, tzinfo=timezone.utc), "day": date(1999, 12, 31),
     "clock": time(23, 59, 58, 7), "u": uuid.UUID(int=12345), "doc": {"k": [1, "two\tthree", None]}},
    {"i": -1, "f": -0.0, "d": Decimal("0"), "s": "", "b": b"", "ok": False, "at": None, "day": None,
     "clock": None, "u": None, "doc": [1, 2]},
    dict.fromkeys(("i", "f", "d", "s", "b", "ok", "at", "day", "clock", "u", "doc")),
]


@pytest.fixture(params=["psycopg2", "psycopg", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    if request.param == "sqlite":
        dsn = f"sqlite:///{tmp_path / 'copy.db'}"
    else:
        dsn = with_driver(request.getfixturevalue("pg_dsn"), request.param)
    eng = make_engine(Settings(dsn=dsn))
    metadata.create_all(eng)
    yield eng
    eng.dispose()


def read(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(kinds).order_by(kinds.c.id))]


def copy_in_batch(engine: sa.Engine, rows: Any, columns: Any = None, table: Any = kinds) -> int:
    with engine.connect() as conn, conn.begin(), batch_session(conn) as session:
        return session.copy_rows(table, rows, columns)


def test_every_value_type_reads_back_as_written(engine: sa.Engine) -> None:
    assert copy_in_batch(engine, ROWS) == 3
    got = read(engine)
    assert [r.pop("id") for r in got] == [1, 2, 3]
    if engine.dialect.name == "sqlite":  # no time zones or microsecond times there
        for r in got:
            r["at"] = r["at"] and r["at"].replace(tzinfo=timezone.utc)
    assert got == ROWS


def test_columns_of_one_type_read_back_as_written(engine: sa.Engine) -> None:
    """Columns whose values are all int, str or bytes are formatted whole (the fast path)."""
    rows = [(i, f"{TRICKY} {i}", bytes([i % 256]) * (i % 7) + b"\\\t\n") for i in range(300)]
    copy_in_batch(engine, rows, columns=["i", "s", "b"])
    assert [(r["i"], r["s"], r["b"]) for r in read(engine)] == rows


def test_rows_sent_in_many_pieces_read_back_as_written(engine: sa.Engine) -> None:
    """A COPY of more rows than a piece (some columns of one type, some mixed, NULLs among them)
    is encoded and sent a piece at a time, and every row reads back as written, in order."""
    n = 3 * COPY_PIECE_ROWS + 7
    rows = [(i, f"{TRICKY} {i}", bytes([i % 256]) * (i % 5), None if i % 3 else Decimal(i) / 7, i % 2 == 0)
            for i in range(n)]
    assert copy_in_batch(engine, rows, columns=["i", "s", "b", "d", "ok"]) == n
    got = [(r["i"], r["s"], r["b"], r["d"], r["ok"]) for r in read(engine)]
    assert got == [(i, s, b, d if d is None else d.quantize(Decimal("0.000001")), ok) for i, s, b, d, ok in rows]


@pytest.mark.parametrize(("driver", "bad"), [("psycopg2", "type"), ("psycopg2", "nul"), ("psycopg2", "encoding"),
                                           ("psycopg", "nul"), ("psycopg", "encoding")])
def test_a_value_it_cannot_send_in_a_late_piece_fails_before_anything_is_sent(pg_dsn: str, driver: str,
                                                                               bad: str) -> None:
    """The value that cannot be sent sits in the third piece: the error comes before the COPY
    starts (a COPY failed midway would leave the transaction aborted), so the transaction goes on.
    (psycopg 3 adapts a type kstore's encoding does not know itself, row by row: above.)"""
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, driver)))
    metadata.create_all(eng)
    value = {"type": object(), "nul": "a\x00b", "encoding": "lone \ud800 surrogate"}[bad]
    error = {"type": TypeError, "nul": ValueError if driver == "psycopg2" else sa.exc.DataError,
             "encoding": UnicodeEncodeError}[bad]
    rows = [{"i": i, "s": value if i == 2 * COPY_PIECE_ROWS + 3 else "fine"} for i in range(3 * COPY_PIECE_ROWS)]
    with eng.connect() as conn, conn.begin(), batch_session(conn) as session:
        with pytest.raises(error) as raised:
            session.copy_rows(kinds, rows)
        assert bad != "encoding" or "NUL" not in str(raised.value)
        session.execute(kinds.insert(), {"i": -1})  # the transaction was not aborted
    assert [r["i"] for r in read(eng)] == [-1]
    eng.dispose()


def test_tuples_in_the_tables_or_the_given_column_order(engine: sa.Engine) -> None:
    copy_in_batch(engine, [(1, 2.0, Decimal(3), "x")], columns=["i", "f", "d", "s"])
    copy_in_batch(engine, [(2, "y")], columns=["i", "s"])
    assert [(r["i"], r["s"], r["f"]) for r in read(engine)] == [(1, "x", 2.0), (2, "y", None)]
    with pytest.raises(ValueError, match="a row has 1 values for 2 columns"):
        copy_in_batch(engine, [(3, "z"), (4,)], columns=["i", "s"])
    with pytest.raises(ValueError, match="a row has keys"):
        copy_in_batch(engine, [{"i": 1, "s": "a"}, {"i": 2}])


def test_a_table_named_by_its_name(engine: sa.Engine) -> None:
    assert copy_in_batch(engine, [{"i": 7, "s": "by name"}], table="kinds") == 1
    assert [(r["i"], r["s"]) for r in read(engine)] == [(7, "by name")]
    with pytest.raises(TypeError, match="give columns"):
        copy_in_batch(engine, [(1, 2)], table="kinds")


def test_writes_deferred_before_it_go_first_and_a_rollback_undoes_it(engine: sa.Engine) -> None:
    with engine.connect() as conn, conn.begin(), batch_session(conn) as session:
        session.execute(kinds.insert(), {"i": 1})
        session.copy_rows(kinds, [{"i": 2}, {"i": 3}])
        session.execute(kinds.insert(), {"i": 4})
    assert [(r["id"], r["i"]) for r in read(engine)] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    with engine.connect() as conn:
        trans = conn.begin()
        with batch_session(conn) as session:
            session.copy_rows(kinds, [{"i": 5}])
        trans.rollback()
    assert [r["i"] for r in read(engine)] == [1, 2, 3, 4]


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_postgresql_only_types(pg_dsn: str, driver: str) -> None:
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, driver)))
    with eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE pg_only (span interval, doc jsonb)"))
    rows = [{"span": timedelta(days=2, seconds=3, microseconds=4), "doc": {"a": "b\\c"}}]
    copy_in_batch(eng, rows, table=pg_only)
    with eng.connect() as conn:
        assert [dict(r._mapping) for r in conn.execute(sa.select(pg_only))] == rows
    eng.dispose()


def test_psycopg3_adapts_what_kstores_encoding_does_not_know(pg_dsn: str) -> None:
    """A value outside kstore's own COPY encoding (an IP address) goes through psycopg 3's own
    adaptation, row by row; psycopg2 has none, and refuses it clearly (below)."""
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, "psycopg")))
    with eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE hosts (ip inet, doc jsonb)"))
    copy_in_batch(eng, [(ipaddress.ip_address("10.0.0.1"), {"k": 1})], columns=["ip", "doc"], table="hosts")
    with eng.connect() as conn:
        assert conn.execute(sa.text("SELECT host(ip), doc FROM hosts")).one() == ("10.0.0.1", {"k": 1})
    eng.dispose()


def test_a_value_it_cannot_write_is_a_clear_type_error(pg_dsn: str) -> None:
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, "psycopg2")))
    metadata.create_all(eng)
    with pytest.raises(TypeError, match="cannot write a object value"):
        copy_in_batch(eng, [{"s": object()}])
    eng.dispose()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_errors_are_sqlalchemys_and_a_cut_connection_is_an_outage(pg_dsn: str, driver: str) -> None:
    """kstore tells a bad row (the batch's failure) from a lost database (retried as it is) by
    SQLAlchemy's exceptions: COPY's must be the same, not the driver's own."""
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, driver)))
    metadata.create_all(eng)
    with pytest.raises(sa.exc.IntegrityError) as refused:
        copy_in_batch(eng, [{"id": 1}, {"id": 1}])
    assert not transient(refused.value)
    with eng.connect() as conn:
        conn.begin()
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with eng.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        with pytest.raises(sa.exc.DBAPIError) as lost, batch_session(conn) as session:
            session.copy_rows(kinds, [{"i": 1}])
        assert lost.value.connection_invalidated and transient(lost.value)
        assert conn.invalidated
    eng.dispose()


@pytest.mark.integration
@pytest.mark.parametrize("write", ["copy", "insert", "text"])
def test_a_row_the_database_refuses_mid_batch_is_dead_lettered_alone(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, write: str) -> None:
    """The poison's row breaks NOT NULL inside the database, in the middle of a COPY (or a
    multi-row INSERT, or a page of text INSERTs) of 500: the whole write fails, the batch is
    rolled back and halved until the message is found; it alone is dead-lettered."""
    topic = new_topic(1)
    good = set(produce(topic, [f"a{i}" for i in range(250)]))
    (poison,) = produce(topic, ["poison"])
    good |= set(produce(topic, [f"b{i}" for i in range(249)]))
    w = workers(pg_dsn, topic, f"refused-{write}", env={"KSTORE_TEST_WRITE": write, "KSTORE_TEST_DB_POISON": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: dead_letter_rows(pg_dsn), 60, what="the poison dead-lettered")
    wait_until(lambda: len(effects(pg_dsn)) >= len(good), 60, what="every good message")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), good)
    (row,) = dead_letter_rows(pg_dsn)
    assert (row.topic, row.partition_id, row.offset) == poison and "NotNullViolation" in row.error
    assert stored_offsets(pg_dsn, f"refused-{write}") == {(topic, 0): 500}
