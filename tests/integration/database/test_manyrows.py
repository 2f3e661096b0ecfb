"""Many rows of one Core INSERT as one statement (kstore/db/manyrows.py).

Against a real PostgreSQL through psycopg2 and psycopg 3: the rows read back as SQLAlchemy's own
executemany writes them (bind processors, NULLs, quotes, percent signs, bytes), all in
one statement; statements that do not qualify take SQLAlchemy's path, unchanged.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from kstore import Settings
from kstore.db.manyrows import execute_many
from kstore.db.session import batch_session
from kstore.db.store import make_engine
from tests.support.harness import with_driver


class Color(enum.Enum):
    red = "r"
    blue = "b"


class Upper(sa.TypeDecorator[str]):
    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else value.upper()


metadata = sa.MetaData()
things = sa.Table(
    "things", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("n", sa.Integer), sa.Column("s", sa.Text), sa.Column("b", sa.LargeBinary), sa.Column("doc", sa.JSON),
    sa.Column("color", sa.Enum(Color)), sa.Column("up", Upper), sa.Column("d", sa.Numeric(10, 2)),
    sa.Column("kind", sa.Text, server_default="plain"),
)
with_default = sa.Table("with_default", metadata, sa.Column("n", sa.Integer, primary_key=True),
                        sa.Column("tag", sa.Text, default="python-side"))

ROWS = [
    {"n": 1, "s": "it's 100% \\ \"quoted\"; %(n)s %s", "b": b"\x00\\\xff'", "doc": {"a": [1, None, "x'y"]},
     "color": Color.red, "up": "shout", "d": 1.25},
    {"n": None, "s": None, "b": None, "doc": None, "color": None, "up": None, "d": None},
    {"n": -7, "s": "ünï 😀\n\t", "b": bytearray(b"ab"), "doc": [1, 2], "color": Color.blue, "up": "x", "d": 0},
]


@pytest.fixture(params=["psycopg2", "psycopg"])
def engine(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[sa.Engine]:
    eng = make_engine(Settings(dsn=with_driver(pg_dsn, request.param)))
    metadata.create_all(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def sent(engine: sa.Engine) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    sa.event.listen(engine, "before_cursor_execute",
                    lambda conn, cursor, sql, params, context, many: out.append((sql, many)))
    return out


def read(engine: sa.Engine) -> list[tuple[Any, ...]]:
    cols = [things.c.n, things.c.s, things.c.b, things.c.doc, things.c.color, things.c.up, things.c.d, things.c.kind]
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(*cols).order_by(things.c.id))]


def write(engine: sa.Engine, statement: Any, rows: list[dict[str, Any]], per_row: bool = False) -> Any:
    with engine.connect() as conn, conn.begin(), batch_session(conn) as session:
        if per_row:
            for row in rows:
                session.execute(statement, row)
            return None
        return session.execute(statement, rows)


def test_rows_read_back_as_sqlalchemys_own_executemany_writes_them(engine: sa.Engine, sent: Any) -> None:
    with engine.begin() as conn:
        conn.execute(things.insert(), ROWS)  # SQLAlchemy's own path: what the rows must read back as
    expected = read(engine)
    with engine.begin() as conn:
        conn.execute(things.delete())
    del sent[:]
    result = write(engine, things.insert(), ROWS)
    assert [many for _, many in sent] == [False], "one statement, not an executemany"
    assert read(engine) == expected
    assert expected[0][4] == Color.red and expected[0][5] == "SHOUT" and json.loads(json.dumps(expected[0][3]))
    assert result.rowcount == 3


def test_deferred_one_row_inserts_go_as_one_statement(engine: sa.Engine, sent: Any) -> None:
    write(engine, things.insert(), [{"n": i, "s": f"r{i}"} for i in range(1500)], per_row=True)
    inserts = [sql for sql, _ in sent if sql.startswith("INSERT")]
    assert len(inserts) == 1 and inserts[0].count("),(") == 1499
    assert [r[0] for r in read(engine)] == list(range(1500))


@pytest.mark.parametrize(("statement", "table"), [
    pytest.param(lambda: with_default.insert(), with_default, id="Python-side column default"),
    pytest.param(lambda: things.insert().values(kind="embedded"), things, id="embedded value"),
    pytest.param(lambda: pg_insert(things).on_conflict_do_update(index_elements=["id"], set_={"s": "again"}),
                 things, id="upsert with its own parameter"),
])
def test_statements_that_do_not_qualify_take_sqlalchemys_path(
        engine: sa.Engine, statement: Any, table: sa.Table) -> None:
    with engine.connect() as conn, conn.begin():
        assert execute_many(conn, statement(), [{"n": 1}, {"n": 2}]) is None
    write(engine, statement(), [{"n": 1}, {"n": 2}])
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 2


def _excluded_s() -> Any:
    upsert = pg_insert(things)
    return upsert.on_conflict_do_update(index_elements=["id"], set_={"s": upsert.excluded.s})


@pytest.mark.parametrize(("statement", "expected"), [
    pytest.param(_excluded_s, [(1, "b"), (2, "c")], id="DO UPDATE SET s = excluded.s"),
    pytest.param(lambda: pg_insert(things).on_conflict_do_update(index_elements=["id"], set_={"s": "again"}),
                 [(1, "again"), (2, "c")], id="DO UPDATE with its own parameter"),
    pytest.param(lambda: pg_insert(things).on_conflict_do_nothing(index_elements=["id"]), [(1, "a"), (2, "c")],
                 id="DO NOTHING"),
])
@pytest.mark.parametrize("per_row", [True, False], ids=["deferred", "executemany"])
def test_upserts_run_one_statement_per_row(engine: sa.Engine, statement: Any, expected: Any, per_row: bool) -> None:
    """A key twice among the rows is updated twice, as the statements one by one do: one multi-row
    upsert would fail ("ON CONFLICT DO UPDATE command cannot affect row a second time")."""
    write(engine, statement(), [{"id": 1, "s": "a"}, {"id": 1, "s": "b"}, {"id": 2, "s": "c"}], per_row=per_row)
    with engine.connect() as conn:
        assert conn.execute(sa.select(things.c.id, things.c.s).order_by(things.c.id)).all() == expected


def test_rows_with_different_keys_take_sqlalchemys_path(engine: sa.Engine) -> None:
    with engine.connect() as conn, conn.begin():
        assert execute_many(conn, things.insert(), [{"n": 1}, {"n": 2, "s": "x"}]) is None
        assert execute_many(conn, things.insert().returning(things.c.id), [{"n": 1}]) is None


def test_a_refused_row_is_sqlalchemys_integrity_error(engine: sa.Engine) -> None:
    with pytest.raises(sa.exc.IntegrityError):
        write(engine, things.insert(), [{"id": 5, "n": 1}, {"id": 5, "n": 2}])
    assert read(engine) == []


TEXT_INSERT = "INSERT INTO things (n, s, b) VALUES (:n, :s, :b)"


@pytest.mark.parametrize(("sql", "one_statement"), [
    pytest.param(TEXT_INSERT, True, id="ends with its VALUES row"),
    pytest.param("insert into things (n, s, b)\n values(:n,:s,:b) ", True, id="lower case, other spacing"),
    pytest.param(TEXT_INSERT + " -- a note", True, id="a comment after the row"),
    pytest.param("/* first */ INSERT INTO things (n, s, b) -- (x)\n VALUES (:n, /* : */ :s, :b);", True,
                 id="comments everywhere and a semicolon"),
    pytest.param("INSERT INTO things (n, s, b, kind) VALUES (:n, :s, :b, 'lit(eral)')", True, id="a literal"),
    pytest.param("INSERT INTO things (n, s, b, kind) VALUES (:n, :s, :b, 'x'::text)", True, id="a cast"),
    pytest.param(TEXT_INSERT + " ON CONFLICT DO NOTHING", False, id="ON CONFLICT"),
    pytest.param(TEXT_INSERT + " ON CONFLICT DO NOTHING -- a note", False, id="ON CONFLICT and a comment"),
    pytest.param("INSERT INTO things (n, s, b) VALUES (:n, lower(:s), :b)", False, id="a function call"),
])
def test_deferred_text_inserts(engine: sa.Engine, sent: Any, sql: str, one_statement: bool) -> None:
    """Deferred ``text()`` INSERTs that end with their VALUES row go as one statement; any other
    shape on psycopg2 as kstore's pages of 500 statements (each page one text ending with its
    sentinel), on psycopg 3 as its executemany. Either way every row reads back as given."""
    rows = [{"n": i, "s": ROWS[0]["s"] + str(i), "b": bytes([i % 256]) + b"\\'"} for i in range(700)]
    write(engine, sa.text(sql), rows, per_row=True)
    inserts = [(text, many) for text, many in sent if "insert" in text.lower()]
    if one_statement:
        assert [many for _, many in inserts] == [False] and inserts[0][0].count("),(") == 699
    elif engine.dialect.driver == "psycopg2":
        assert [many for _, many in inserts] == [False, False]
        assert [text.count(";\n") for text, _ in inserts] == [500, 200]
        assert [text.rsplit("\n", 1)[1] for text, _ in inserts] == ["SELECT 500", "SELECT 200"]
    else:
        assert [many for _, many in inserts] == [True]
    got = [(n, s, b) for n, s, b, *_ in read(engine)]
    if "lower(" in sql:
        rows = [{**r, "s": r["s"].lower()} for r in rows]
    assert got == [(r["n"], r["s"], r["b"]) for r in rows]


def test_psycopg3_keeps_no_copy_of_the_statements(engine: sa.Engine) -> None:
    """psycopg 3 remembers the text of its last 100 statements to choose which to prepare; a
    multi-row INSERT is a new text every time (1 MB for 5,000 rows): it must not be kept (peak
    RSS grew by 120 MB in the benchmark before it was excluded)."""
    for i in range(5):
        write(engine, things.insert(), [{"n": n, "s": "x" * 100} for n in range(i * 200, i * 200 + 200)])
    with engine.connect() as conn:
        dbapi: Any = conn.connection.dbapi_connection
        kept = getattr(getattr(dbapi, "_prepared", None), "_counts", {})  # psycopg 3 only
        assert not [key for key in kept if len(key[0]) > 10_000]
        assert getattr(dbapi, "prepare_threshold", 5) == 5, "psycopg's own setting is restored"
