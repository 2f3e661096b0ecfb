"""kstore's own SQL literals (kstore/db/literals.py) against the drivers', on a real PostgreSQL.

The driver's ``mogrify`` is the oracle (psycopg2's cursor's, psycopg 3's ``ClientCursor``'s): for
every value kstore writes itself, its literal must be the driver's byte for byte; any other value
must be left to the driver. Then what the connection can change: ``standard_conforming_strings``
turned off by a ``SET`` and an adapter registered by the user each put the rows back on the
driver's quoting, and the rows still read back as written.
"""

from __future__ import annotations

import enum
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kstore.db import literals, manyrows
from kstore.db.session import batch_session
from tests.support.harness import with_driver


class Level(enum.IntEnum):
    low = 1


DRIVERS = ("psycopg2", "psycopg")


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def raw(pg_dsn: str, driver: str) -> Iterator[Any]:
    """A connection of ``driver`` (not SQLAlchemy's) to the test database."""
    url = sa.engine.make_url(with_driver(pg_dsn, driver))
    connect = psycopg.connect if driver == "psycopg" else psycopg2.connect
    conn = connect(host=url.host, port=url.port, user=url.username, dbname=url.database)
    yield conn
    conn.close()


def mogrify(raw: Any, template: str, params: Any) -> str:
    """The driver's own quoting of ``params`` into ``template`` (psycopg 3: on the client)."""
    if isinstance(raw, psycopg.Connection):
        with psycopg.ClientCursor(raw) as cur:
            return cur.mogrify(template, params)
    with raw.cursor() as cur:
        return str(cur.mogrify(template, params).decode())


#: What a driver raises for a value it refuses to quote (a NUL in a string).
REFUSED = (ValueError, psycopg.DataError)


ours = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**63) - 2, 2**63 + 2),
    st.floats(), st.sampled_from([0.0, -0.0, 1e300, -1e-300, 5e-324]),
    st.text(alphabet=st.characters(max_codepoint=127)), st.text(), st.binary(),
    st.sampled_from(["it's", "''", "\\", "\\'", "a\x00b", "ünï", "%s", "%(x)s", "{}", "{0}", "--", "/*",
                     "a\\b'c", "\\\\", "\\x41"]),
)
theirs = st.one_of(
    st.decimals(allow_nan=False), st.sampled_from([Level.low, bytearray(b"ab"), memoryview(b"ab")]),
    st.lists(st.integers(), max_size=3), st.dates(),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(ours, theirs))
@example(value=-(2**63))
@example(value="a'b''c")
@example(value=b"\x00'\\\xff")
@example(value=-0.0)
@example(value=float("nan"))
@example(value="a\\b")
def test_a_literal_is_the_drivers_own_or_left_to_it(raw: Any, driver: str, value: Any) -> None:
    """kstore writes the driver's literal, byte for byte, or nothing (None: the driver quotes it)."""
    assert literals.stock_quoting(raw, driver)
    written = literals.literal(value, driver)
    if type(value) in (bool, int, float, bytes, type(None)):
        assert written is not None, f"{value!r} should be kstore's to write"
    if written is None:
        assert not (type(value) is str and value.isascii() and "\x00" not in value)
        return
    assert written == mogrify(raw, "%s", (value,))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.fixed_dictionaries({"a": st.one_of(ours, theirs), "b": ours}), min_size=1, max_size=5),
       template=st.sampled_from(["(%(a)s, %(b)s)", "(%(b)s::text, '100%%', %(a)s)", "({%(a)s}, %(b)s, %(a)s)"]))
def test_rows_are_quoted_as_mogrify_quotes_them(raw: Any, driver: str, rows: list[dict[str, Any]],
                                                template: str) -> None:
    """A whole template, placeholders repeated, with literal percent signs and braces: each row as mogrify writes it."""
    form = literals.RowFormat.of(template, driver)
    assert form is not None
    for row in rows:
        mine = form.row(row)
        try:
            theirs = mogrify(raw, template, row)
        except REFUSED:  # a NUL in a string: the driver refuses it, so kstore must not write it
            assert mine is None
            continue
        assert mine is None or mine == theirs


table = sa.Table("literal_t", sa.MetaData(), sa.Column("n", sa.BigInteger), sa.Column("s", sa.Text),
                 sa.Column("b", sa.LargeBinary))
ROWS: list[dict[str, Any]] = [{"n": -5, "s": "back\\slash 'quoted'", "b": b"\\x00'"}, {"n": 7, "s": "ünï", "b": b""},
        {"n": None, "s": "\\'; --", "b": None}]


def _write_and_read(engine: sa.Engine, before: str | None = None) -> list[tuple[Any, ...]]:
    with engine.begin() as conn:
        table.drop(conn, checkfirst=True)
        table.create(conn)
    with engine.connect() as conn, conn.begin():
        if before:
            conn.exec_driver_sql(before)
        with batch_session(conn) as session:
            for row in ROWS:
                session.execute(table.insert(), row)
        return [tuple(r) for r in conn.execute(sa.select(table.c.n, table.c.s, table.c.b))]


def _expected() -> list[tuple[Any, ...]]:
    return [(r["n"], r["s"], r["b"]) for r in ROWS]


def test_strings_read_as_written_when_the_session_turns_standard_conforming_strings_off(pg_dsn: str, driver: str,
                                                                                         raw: Any) -> None:
    """With ``standard_conforming_strings`` off a backslash escapes: kstore's literals would be read
    otherwise, so the rows go through the driver's quoting (``E'...'``), and read back as written."""
    raw.cursor().execute("SET standard_conforming_strings = off")
    assert not literals.stock_quoting(raw, driver)
    engine = sa.create_engine(with_driver(pg_dsn, driver))
    try:
        rows = _write_and_read(engine, before="SET LOCAL standard_conforming_strings = off")
    finally:
        engine.dispose()
    assert [(n, s, bytes(b) if b is not None else None) for n, s, b in rows] == _expected()


class _Tagged:
    """psycopg2: an adapter of ints that writes ten times the value."""

    def __init__(self, value: int) -> None:
        self.value = value

    def getquoted(self) -> bytes:
        return str(self.value * 10).encode()


class _TaggedDumper(psycopg.adapt.Dumper):
    """psycopg 3: the same, as a text dumper."""

    oid = psycopg.postgres.types["int8"].oid

    def dump(self, obj: int) -> bytes:
        return str(obj * 10).encode()


def test_an_adapter_the_user_registered_is_used_as_the_driver_would(pg_dsn: str, driver: str, raw: Any) -> None:
    """``register_adapter(int, ...)`` (psycopg2, for every connection) or ``adapters.register_dumper(int,
    ...)`` (psycopg 3, here on each of the engine's connections) changes what the driver writes for
    every int: kstore then quotes nothing itself, and the rows carry the user's adapter, as on the
    plain path."""
    assert literals.stock_quoting(raw, driver)
    engine = sa.create_engine(with_driver(pg_dsn, driver))
    if driver == "psycopg":
        raw.adapters.register_dumper(int, _TaggedDumper)
        assert not literals.stock_quoting(raw, driver)
        sa.event.listen(engine, "connect", lambda dbapi, _record: dbapi.adapters.register_dumper(int, _TaggedDumper))
    else:
        psycopg2.extensions.register_adapter(int, _Tagged)
    try:
        if driver == "psycopg2":
            assert not literals.stock_quoting(raw, driver)
        rows = _write_and_read(engine)
    finally:
        engine.dispose()
        if driver == "psycopg2":
            psycopg2.extensions.register_adapter(int, psycopg2.extensions.Int)
    if driver == "psycopg2":
        assert literals.stock_quoting(raw, driver)
    assert [n for n, _, _ in rows] == [-50, 70, None]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_literal_that_differed_from_the_drivers_would_never_be_sent(
        pg_dsn: str, driver: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The last guard: each batch's first row is also quoted by the driver and compared. A wrong literal
    (here made on purpose) puts the whole batch on the driver's quoting, with a warning."""
    monkeypatch.setitem(literals.LITERALS[driver], int, lambda value: str(value + 1))
    monkeypatch.setattr(manyrows, "_FORMATS", {})
    engine = sa.create_engine(with_driver(pg_dsn, driver))
    try:
        with caplog.at_level(logging.WARNING, logger="kstore.db.manyrows"):
            rows = _write_and_read(engine)
    finally:
        engine.dispose()
    assert [(n, s, bytes(b) if b is not None else None) for n, s, b in rows] == _expected()
    assert f"differs from {driver}'s" in caplog.text


@pytest.mark.parametrize("driver", DRIVERS)
def test_values_kstore_does_not_write_go_through_the_driver_in_the_same_statement(pg_dsn: str, driver: str) -> None:
    """A batch mixing kstore's values and others (Decimal, IntEnum): each row quoted by either, all written."""
    mixed = sa.Table("literal_mixed", sa.MetaData(), sa.Column("n", sa.Numeric), sa.Column("s", sa.Text))
    engine = sa.create_engine(with_driver(pg_dsn, driver))
    try:
        with engine.begin() as conn:
            mixed.create(conn)
        values = [Decimal("1.5"), 2, Level.low, None, 3.25]
        with engine.connect() as conn, conn.begin():
            with batch_session(conn) as session:
                for i, n in enumerate(values):
                    session.execute(mixed.insert(), {"n": n, "s": f"r{i}"})
            got = {s: n for s, n in conn.execute(sa.select(mixed.c.s, mixed.c.n))}
    finally:
        engine.dispose()
    assert got == {"r0": Decimal("1.5"), "r1": 2, "r2": 1, "r3": None, "r4": Decimal("3.25")}


PURE_PYTHON_CHECK = """
import sys, psycopg
from kstore.db import literals
assert psycopg.pq.__impl__ == "python", psycopg.pq.__impl__
values = [None, True, False, 0, 7, -7, 2**70, -(2**63), 1.5, -1.5, 0.0, -0.0, 5e-324, 1e300,
          float("nan"), float("inf"), -float("inf"), "", "it's", "a\\\\b'c", "\\\\x41", "%s", b"", b"\\x00'\\\\\\xff"]
with psycopg.connect(sys.argv[1]) as conn, psycopg.ClientCursor(conn) as cur:
    assert literals.stock_quoting(conn, "psycopg")
    for value in values:
        mine, theirs = literals.literal(value, "psycopg"), cur.mogrify("%s", (value,))
        assert mine == theirs, (value, mine, theirs)
print(len(values))
"""


def test_psycopg_3s_pure_python_dumpers_write_the_same(pg_dsn: str) -> None:
    """``kstore[psycopg]`` installs psycopg 3 without its C speed-ups: its Python dumpers are psycopg's
    own too, and kstore's literals are theirs byte for byte (run in a process of their own:
    ``PSYCOPG_IMPL`` is read once, at psycopg's import)."""
    url = sa.engine.make_url(with_driver(pg_dsn, "psycopg"))
    conninfo = f"host={url.host} port={url.port} user={url.username} dbname={url.database}"
    done = subprocess.run([sys.executable, "-c", PURE_PYTHON_CHECK, conninfo], capture_output=True, text=True,
                          env={**os.environ, "PSYCOPG_IMPL": "python"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "24"
