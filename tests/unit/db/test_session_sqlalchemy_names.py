"""The private SQLAlchemy names kstore still reads (listed in kstore/db/session.py and
kstore/db/manyrows.py, each for want of a public API) are there and mean what kstore takes them to
mean, on the SQLAlchemy installed: an upgrade that renames or changes one fails here, by name,
before any other test. And the public replacement of ``Session._is_clean()`` answers as it does.

pyproject.toml allows the SQLAlchemy minors these pass on (a new minor may change private names).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kstore.db.session import BatchSession

metadata = sa.MetaData()
table = sa.Table("names_t", metadata, sa.Column("id", sa.Integer, primary_key=True), sa.Column("a", sa.Integer))
other = sa.Table("names_u", metadata, sa.Column("id", sa.Integer, primary_key=True))


class Base(DeclarativeBase):
    pass


class Thing(Base):
    __tablename__ = "names_things"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str]


def test_insert_returning_return_defaults_and_multi_values() -> None:
    plain = sa.insert(table)
    assert not plain._returning and not plain._return_defaults and not plain._multi_values
    assert plain.select is None  # public: INSERT ... SELECT
    assert plain.returning(table.c.id)._returning
    assert plain.return_defaults()._return_defaults
    assert plain.values([{"a": 1}, {"a": 2}])._multi_values


def test_propagate_attrs_tells_orm_statements() -> None:
    assert not sa.insert(table)._propagate_attrs
    assert not sa.text("SELECT 1")._propagate_attrs
    assert sa.select(Thing)._propagate_attrs
    assert sa.insert(Thing)._propagate_attrs


def test_cache_key_is_same_sql() -> None:
    a, b = sa.insert(table), sa.insert(table)
    ka, kb = a._generate_cache_key(), b._generate_cache_key()
    assert ka is not None and kb is not None and ka == kb and ka.key == kb.key
    ko = sa.insert(other)._generate_cache_key()
    assert ko is not None and ko.key != ka.key
    one, two = sa.insert(table).values(a=1)._generate_cache_key(), sa.insert(table).values(a=2)._generate_cache_key()
    assert one is not None and two is not None
    assert [p.effective_value for p in one.bindparams] != [p.effective_value for p in two.bindparams]


def test_post_values_clause_tells_an_upsert() -> None:
    assert sa.insert(table)._post_values_clause is None
    assert postgresql.insert(table)._post_values_clause is None
    assert postgresql.insert(table).on_conflict_do_nothing()._post_values_clause is not None


def test_text_bindparams() -> None:
    bound = sa.text("INSERT INTO t (a, b) VALUES (:a, :b)").bindparams(sa.bindparam("b", type_=sa.JSON))
    assert set(bound._bindparams) == {"a", "b"}
    assert isinstance(bound._bindparams["b"].type, sa.JSON) and bound._bindparams["a"].value is None


def test_insertmanyvalues_gives_the_one_row_values() -> None:
    compiled: Any = sa.insert(table).compile(dialect=postgresql.psycopg2.dialect(), column_keys=["id", "a"],
                                             for_executemany=True)
    many = compiled._insertmanyvalues
    assert many is not None and not many.is_default_expr and not many.has_upsert_bound_parameters
    assert f"({many.single_values_expr})" in compiled.string


@pytest.mark.parametrize("change", ["none", "add", "modify", "delete", "flushed"])
def test_the_public_orm_check_answers_as_is_clean(change: str) -> None:
    engine = sa.create_engine("sqlite://")
    Base.metadata.create_all(engine)
    with engine.connect() as conn, conn.begin():
        session = BatchSession(conn, join_transaction_mode="rollback_only")
        if change != "none":
            thing = Thing(name="x")
            session.add(thing)
            if change != "add":
                session.flush()
            if change == "modify":
                thing.name = "y"
            elif change == "delete":
                session.delete(thing)
        assert session._orm_clean() == session._is_clean() == (change in ("none", "flushed"))
        session._end()
    engine.dispose()


def test_a_plain_session_is_left_alone() -> None:
    """The listener is BatchSession's alone: another Session is left as it is."""
    session = Session()
    session.add(Thing(name="x"))
    assert not hasattr(session, "_orm_attached")
