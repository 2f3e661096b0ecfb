"""kstore.db.sqltext: what a ``text()`` is, judged by PostgreSQL's tokens (comments, literals, dollar quotes).

Pure logic, no database: the verdicts the batch session and kstore.db.manyrows take from it. The
differential test (tests/integration/database/test_differential.py) runs the same shapes against PostgreSQL.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kstore.db.sqltext import body_of, ending_values_row, is_one_insert, tokens


@pytest.mark.parametrize("sql", [
    "INSERT INTO t (a) VALUES (:a)",
    "insert into t (a) values (:a);",
    "INSERT INTO t (a) VALUES (:a) -- a note",
    "INSERT INTO t (a) VALUES (:a); -- a note",
    "/* first */ -- and a line\nINSERT INTO t (a) VALUES (:a) /* a /* nested */ one; RETURNING */",
    "INSERT INTO t (a, b) VALUES (:a, 'RETURNING; -- /*')",
    "INSERT INTO t (a, b) VALUES (:a, E'it\\'s; RETURNING')",
    "INSERT INTO t (a, b) VALUES (:a, $$ ; RETURNING $$)",
    "INSERT INTO t (a, b) VALUES (:a, $tag$ $$ ; $tag$)",
    'INSERT INTO "returning" (";") VALUES (:a)',
    "INSERT INTO t (a) VALUES (:a) ON CONFLICT (a) DO UPDATE SET a = excluded.a",
    "INSERT INTO t (a) SELECT :a WHERE NOT EXISTS (SELECT 1 FROM t)",
])
def test_one_insert_without_returning(sql: str) -> None:
    assert is_one_insert(sql)


@pytest.mark.parametrize("sql", [
    "INSERT INTO t (a) VALUES (:a) RETURNING id",
    "insert into t (a) values (:a) returning *",
    "INSERT INTO t (a) VALUES (:a); DELETE FROM t",
    "INSERT INTO t (a) VALUES (:a);;",
    "INSERT INTO t (a) VALUES (:a) /* comment */ ; SELECT 1",
    "WITH x AS (SELECT :a AS a) INSERT INTO t (a) SELECT a FROM x",
    "UPDATE t SET a = :a",
    "-- INSERT INTO t (a) VALUES (:a)\nDELETE FROM t",
    "INSERT INTO t (a) VALUES ('unterminated",
    "INSERT INTO t (a) VALUES (:a) /* unterminated /* nested */",
    "INSERT INTO t (a) VALUES ($$unterminated)",
    'INSERT INTO "unterminated (a) VALUES (:a)',
    "",
    "  -- only a comment",
])
def test_not_one_insert_or_returning_rows(sql: str) -> None:
    assert not is_one_insert(sql)


@pytest.mark.parametrize(("sql", "body"), [
    ("INSERT INTO t VALUES (1) -- note", "INSERT INTO t VALUES (1)"),
    ("INSERT INTO t VALUES (1); /* x */\n-- y\n", "INSERT INTO t VALUES (1)"),
    ("INSERT INTO t -- inner\nVALUES ('--')", "INSERT INTO t -- inner\nVALUES ('--')"),
    ("INSERT INTO t VALUES (1); SELECT 2", None),
])
def test_the_body_ends_at_the_last_token(sql: str, body: str | None) -> None:
    assert body_of(sql) == body


@pytest.mark.parametrize(("sql", "split"), [
    ("INSERT INTO t (a, b) VALUES (%(a)s, %(b)s)", ("INSERT INTO t (a, b) VALUES ", "(%(a)s, %(b)s)")),
    ("INSERT INTO t (a, b) VALUES (%(a)s, %(b)s::jsonb); -- note",
     ("INSERT INTO t (a, b) VALUES ", "(%(a)s, %(b)s::jsonb)")),
    ("INSERT INTO t (a, b) values(%(a)s, /* ) */ 'x)' -- )\n)",
     ("INSERT INTO t (a, b) values", "(%(a)s, /* ) */ 'x)' -- )\n)")),
    ("INSERT INTO t (a, b) VALUES (%(a)s, NULL)", ("INSERT INTO t (a, b) VALUES ", "(%(a)s, NULL)")),
    # psycopg 3's dialect casts each parameter, a timezone-aware DateTime's to a type of four words.
    ("INSERT INTO t (a, b, c) VALUES (%(a)s::VARCHAR, %(b)s::TIMESTAMP WITH TIME ZONE, %(c)s::DOUBLE PRECISION)",
     ("INSERT INTO t (a, b, c) VALUES ",
      "(%(a)s::VARCHAR, %(b)s::TIMESTAMP WITH TIME ZONE, %(c)s::DOUBLE PRECISION)")),
    ("INSERT INTO t (a) VALUES (%(a)s::time without time zone)",
     ("INSERT INTO t (a) VALUES ", "(%(a)s::time without time zone)")),
])
def test_the_ending_values_row_is_found_by_its_tokens(sql: str, split: tuple[str, str]) -> None:
    assert ending_values_row(sql) == split


@pytest.mark.parametrize("sql", [
    "INSERT INTO t (a) VALUES (%(a)s) ON CONFLICT DO NOTHING",
    "INSERT INTO t (a) VALUES (%(a)s) ON CONFLICT (a) DO UPDATE SET a = (excluded.a)",
    "INSERT INTO t (a) SELECT * FROM (VALUES (%(a)s)) v",
    "INSERT INTO t (a) VALUES ((SELECT count(*) FROM t))",
    "INSERT INTO t (a) VALUES (lower(%(a)s))",
    "INSERT INTO t (a) VALUES (%(a)s), (%(b)s)",
    "INSERT INTO t (a) VALUES (%(a)s) RETURNING (a)",
    "INSERT INTO t (a, b) SELECT %(b)s, x FROM u VALUES (%(a)s)",
    "INSERT INTO t (a) VALUES (%(a)s); INSERT INTO t (a) VALUES (%(a)s)",
    "INSERT INTO t (a) VALUES (%(a)s::TIMESTAMP WITH now)",
    "INSERT INTO t (a) VALUES (%(a)s::INTEGER WITH TIME ZONE)",
    "INSERT INTO t (a) VALUES (%(a)s::)",
])
def test_no_single_values_row_at_the_end(sql: str) -> None:
    assert ending_values_row(sql) is None


@given(st.text(alphabet=st.sampled_from(list("'\"$-/*;\n\\ eEa1:%()")), max_size=40))
def test_tokens_give_the_text_back_or_nothing(sql: str) -> None:
    toks = tokens(sql)
    assert toks is None or "".join(t.text for t in toks) == sql
