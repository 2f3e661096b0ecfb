"""The processor's session (kstore.db.session) on SQLite: it defers one-row INSERTs and sends them
together, keeping the session's contract (order, reading your writes, results, savepoints, the
ORM, a failed send), and the SQLAlchemy behaviour it relies on is pinned here. A processor that
closes its session keeps its writes; one that rolls it back fails its batch whole.

What matters to exactly-once against PostgreSQL and Kafka (an INSERT that fails when it is finally
sent fails its batch, even under a later message's savepoint, and is pinned to its own message) is
in tests/integration/database/test_deferred_inserts.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, InvalidRequestError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kstore import BatchRollbackError, Message, Processor, Settings
from kstore.db.session import BatchSession, DeferredInsertError, DeferredResult, _deferrable, batch_session
from kstore.db.store import make_engine
from kstore.testing import make_message, run_batch
from tests.support.processors import SessionMisuse, metadata


class Base(DeclarativeBase):
    pass


class Item(Base):
    __tablename__ = "items"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String(50), unique=True)
    kind: Mapped[str] = mapped_column(sa.String(10), default="plain")


items = Item.__table__


#: One row per message, written after the message's other INSERT (so the two alternate).
seen = sa.Table("seen", Base.metadata, sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                sa.Column("msg_offset", sa.Integer, nullable=False))


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    eng = make_engine(Settings(dsn=f"sqlite:///{tmp_path / 'session.db'}"))  # as the worker makes it
    Base.metadata.create_all(eng)
    yield eng
    eng.dispose()


@pytest.fixture()
def statements(engine: sa.Engine) -> list[tuple[str, bool]]:
    """Every statement sent to the database: (SQL, executemany)."""
    sent: list[tuple[str, bool]] = []
    sa.event.listen(engine, "before_cursor_execute",
                    lambda conn, cursor, sql, params, context, many: sent.append((sql, many)))
    return sent


def in_session(engine: sa.Engine, work: Any, defer: bool = True) -> Any:
    """Run ``work(session)`` in a BatchSession inside one committed transaction, as the worker does."""
    with engine.connect() as conn, conn.begin(), batch_session(conn, defer_inserts=defer) as session:
        return work(session)


def names(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(items.c.name).order_by(items.c.id)).scalars())


def inserts(statements: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    return [(sql, many) for sql, many in statements if sql.startswith("INSERT")]


def seen_offsets(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(seen.c.msg_offset).order_by(seen.c.id)).scalars())


def test_one_row_inserts_are_sent_together_at_the_end(engine: sa.Engine, statements: Any) -> None:
    def work(session: BatchSession) -> None:
        for i in range(50):
            # A fresh statement object each time, as most code writes it.
            result = session.execute(sa.insert(items), {"name": f"n{i}"})
            assert isinstance(result, DeferredResult)
        assert not inserts(statements), "nothing sent before the session needs the database"

    in_session(engine, work)
    assert names(engine) == [f"n{i}" for i in range(50)]
    assert inserts(statements) == [(inserts(statements)[0][0], True)], "one executemany for the 50 rows"


INSERT_TEXT = "INSERT INTO items (name, kind) VALUES (:name, :kind)"


def test_text_inserts_are_deferred_and_sent_together(engine: sa.Engine, statements: Any) -> None:
    """``text("INSERT ...")`` per message, as most users write it: deferred like a Core INSERT, in
    order with the statements around it, equal SQL sent as one executemany."""
    def work(session: BatchSession) -> None:
        for i in range(20):
            result = session.execute(sa.text(INSERT_TEXT), {"name": f"t{i}", "kind": "text"})
            assert isinstance(result, DeferredResult)
        assert not inserts(statements), "nothing sent before the session needs the database"
        count = session.execute(sa.text("SELECT count(*) FROM items WHERE kind = 'text'")).scalar_one()
        assert count == 20, "a read sends them first"
        session.execute(sa.text(INSERT_TEXT), {"name": "last", "kind": "text"})
        assert session.execute(sa.text(INSERT_TEXT), {"name": "alone", "kind": "x"}).rowcount == 1

    in_session(engine, work)
    assert names(engine) == [*(f"t{i}" for i in range(20)), "last", "alone"]
    assert [many for _, many in inserts(statements)] == [True, False, False]


@pytest.mark.parametrize("sql", [
    pytest.param("INSERT INTO items (name, kind) VALUES (:name, 'k') RETURNING id", id="returning"),
    pytest.param("insert into items (name, kind) values (:name, 'k') returning id", id="returning, lower case"),
    pytest.param("INSERT INTO items (name, kind) VALUES (:name, 'k'); DELETE FROM items WHERE name = 'never'",
                 id="two statements"),
    pytest.param("WITH n AS (SELECT :name AS name) INSERT INTO items (name, kind) SELECT name, 'k' FROM n",
                 id="WITH first"),
    pytest.param("UPDATE items SET kind = :name WHERE false", id="not an INSERT"),
])
def test_text_that_returns_rows_or_is_not_one_insert_runs_at_once(
        engine: sa.Engine, statements: Any, sql: str) -> None:
    def work(session: BatchSession) -> None:
        before = len(statements)
        result = session.execute(sa.text(sql), {"name": "x"})
        assert not isinstance(result, DeferredResult)
        assert statements[before:] == [(sql.replace(":name", "?"), False)], "sent at once, by execute() itself"

    if "; DELETE" in sql:  # SQLite's driver runs one statement at a time: judged, not run
        assert not _deferrable(sa.text(sql), {"name": "x"})
        return
    in_session(engine, work)


def test_without_deferral_each_insert_is_its_own_statement(engine: sa.Engine, statements: Any) -> None:
    in_session(engine, lambda s: [s.execute(sa.insert(items), {"name": f"n{i}"}) for i in range(5)], defer=False)
    assert names(engine) == [f"n{i}" for i in range(5)]
    assert len(inserts(statements)) == 5 and not any(many for _, many in inserts(statements))


def test_a_parameter_dict_reused_for_every_row_is_copied(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        row: dict[str, Any] = {}
        for i in range(3):
            row["name"] = f"n{i}"
            session.execute(items.insert(), row)

    in_session(engine, work)
    assert names(engine) == ["n0", "n1", "n2"]


def test_reads_see_the_writes_made_before_them(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> tuple[int, int, int]:
        session.execute(items.insert(), {"name": "a"})
        session.execute(items.insert(), {"name": "b"})
        counted = session.scalar(sa.select(sa.func.count()).select_from(items))
        session.execute(items.insert(), {"name": "c"})
        via_execute = session.execute(sa.select(sa.func.count()).select_from(items)).scalar_one()
        session.execute(items.insert(), {"name": "d"})
        via_connection = session.connection().execute(sa.select(sa.func.count()).select_from(items)).scalar_one()
        return counted, via_execute, via_connection

    assert in_session(engine, work) == (2, 3, 4)


def test_order_is_kept_between_inserts_and_other_statements(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        session.execute(items.insert(), {"name": "a"})
        session.execute(items.update().where(items.c.name == "a").values(kind="updated"))
        session.execute(items.insert(), {"name": "b"})
        session.execute(items.delete().where(items.c.name == "b"))
        session.execute(items.insert(), {"name": "c"})

    in_session(engine, work)
    with engine.connect() as conn:
        assert conn.execute(sa.select(items.c.name, items.c.kind).order_by(items.c.id)).all() == [
            ("a", "updated"), ("c", "plain")]


def test_statements_with_different_embedded_values_are_not_merged(engine: sa.Engine, statements: Any) -> None:
    def work(session: BatchSession) -> None:
        session.execute(sa.insert(items).values(kind="x"), {"name": "a"})
        session.execute(sa.insert(items).values(kind="y"), {"name": "b"})
        session.execute(sa.insert(items).values(kind="y"), {"name": "c"})
        session.execute(sa.insert(items), {"name": "d", "kind": "z"})

    in_session(engine, work)
    with engine.connect() as conn:
        assert conn.execute(sa.select(items.c.name, items.c.kind).order_by(items.c.id)).all() == [
            ("a", "x"), ("b", "y"), ("c", "y"), ("d", "z")]
    assert len(inserts(statements)) == 3, "b and c share a statement; a and d do not"


def test_reading_a_result_runs_that_insert_at_once(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        session.execute(items.insert(), {"name": "a"})
        second = session.execute(items.insert(), {"name": "b"})
        session.execute(items.insert(), {"name": "c"})
        assert second.inserted_primary_key == (2,)
        assert second.rowcount == 1
        late = session.execute(items.insert(), {"name": "d"})
        session.execute(items.insert(), {"name": "e"})
        session.flush()
        with pytest.raises(InvalidRequestError, match="sent together with others"):
            _ = late.inserted_primary_key

    in_session(engine, work)
    assert names(engine) == ["a", "b", "c", "d", "e"], "reading a result early does not change the order"


def test_orm_objects_and_core_inserts_keep_their_order(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        session.add(Item(name="orm-1"))
        session.execute(items.insert(), {"name": "core-2"})
        session.add(Item(name="orm-3"))
        session.execute(items.insert(), {"name": "core-4"})
        session.add(Item(name="orm-5"))

    in_session(engine, work)
    assert names(engine) == ["orm-1", "core-2", "orm-3", "core-4", "orm-5"]


def test_a_failing_insert_raises_when_sent_and_rolls_back_the_batch(engine: sa.Engine) -> None:
    class Inserter(Processor):
        def handle(self, msg: Message) -> None:
            self.session.execute(items.insert(), {"name": msg.value.decode()})

    with pytest.raises(IntegrityError):
        run_batch(Inserter(), [make_message(b"a"), make_message(b"b", offset=1), make_message(b"a", offset=2)],
                  engine)
    assert names(engine) == [], "the whole batch rolled back"


class SavepointAfterDuplicate(Processor):
    """Per message a deferred INSERT into items, then one into seen; a value starting with
    "check:" is written under a savepoint that catches IntegrityError, as the README shows.

    With the values a, b, a, c, check:x, d the duplicate fails when check:x's begin_nested()
    sends the INSERTs deferred before it: that is message 2's error, not the savepoint's.
    """

    def handle(self, msg: Message) -> None:
        name = msg.value.decode()
        if name.startswith("check:"):
            try:
                with self.session.begin_nested():
                    self.session.execute(items.insert(), {"name": name})
            except IntegrityError:
                pass  # the savepoint's own duplicate: skip it
        else:
            self.session.execute(items.insert(), {"name": name})
        self.session.execute(seen.insert(), {"msg_offset": msg.offset})


DUPLICATE_THEN_SAVEPOINT = [make_message(v, offset=i) for i, v in enumerate([b"a", b"b", b"a", b"c", b"check:x", b"d"])]


def test_a_failed_deferred_insert_is_not_caught_as_the_error_of_what_sent_it(engine: sa.Engine) -> None:
    raised: list[BaseException] = []

    class Recording(SavepointAfterDuplicate):
        def handle(self, msg: Message) -> None:
            try:
                super().handle(msg)
            except Exception as exc:
                raised.append(exc)
                raise

    with pytest.raises(IntegrityError):
        run_batch(Recording(), DUPLICATE_THEN_SAVEPOINT, engine)
    (error,) = raised
    assert isinstance(error, DeferredInsertError) and not isinstance(error, sa.exc.SQLAlchemyError)
    assert isinstance(error.__cause__, IntegrityError), "the original error is its cause"
    message = str(error)
    assert "INSERT INTO items" in message and "UNIQUE constraint failed: items.name" in message, message
    assert "deferred" in message, message


def test_a_processor_that_swallows_the_error_still_cannot_commit_its_batch(engine: sa.Engine) -> None:
    class Swallowing(SavepointAfterDuplicate):
        def handle(self, msg: Message) -> None:
            with contextlib.suppress(Exception):  # careless: hides every error, this message's or not
                super().handle(msg)

    with pytest.raises(IntegrityError, match=r"UNIQUE constraint failed: items\.name"):
        run_batch(Swallowing(), DUPLICATE_THEN_SAVEPOINT, engine)
    assert names(engine) == [] and seen_offsets(engine) == []


def test_after_a_failed_send_every_use_of_the_session_raises_it_again(engine: sa.Engine) -> None:
    uses: dict[str, Any] = {
        "execute a SELECT": lambda s: s.execute(sa.select(items)),
        "execute an INSERT": lambda s: s.execute(items.insert(), {"name": "later"}),
        "execute an UPDATE": lambda s: s.execute(items.update().values(kind="x")),
        "scalar": lambda s: s.scalar(sa.select(sa.func.count()).select_from(items)),
        "scalars": lambda s: s.scalars(sa.select(items.c.name)),
        "get": lambda s: s.get(Item, 1),
        "connection": lambda s: s.connection(),
        "flush": lambda s: s.flush(),
        "begin_nested": lambda s: s.begin_nested(),
        "bulk_insert_mappings": lambda s: s.bulk_insert_mappings(Item, [{"name": "bulk"}]),
        "read a deferred INSERT's result": lambda s: s.execute(items.insert(), {"name": "r"}).rowcount,
    }
    tried: list[str] = []
    with engine.connect() as conn, conn.begin():
        with pytest.raises(IntegrityError) as at_the_end, batch_session(conn) as session:
            session.execute(items.insert(), {"name": "a"})
            session.execute(items.insert(), {"name": "a"})
            session.execute(seen.insert(), {"msg_offset": 1})  # deferred after the failing INSERT
            for what, use in uses.items():
                with pytest.raises(DeferredInsertError) as caught:
                    use(session)
                assert isinstance(caught.value.__cause__, IntegrityError), what
                tried.append(what)
        assert tried == list(uses)
        assert "UNIQUE constraint failed: items.name" in str(at_the_end.value), "the original error ends the block"
        conn.rollback()
    assert names(engine) == [] and seen_offsets(engine) == []


def test_an_insert_that_fails_when_its_result_is_read_raises_its_own_error(engine: sa.Engine) -> None:
    """Reading a result runs that INSERT alone, as if it had not been deferred: its own error is
    its own (like an INSERT that is not deferred, it can be caught), and nothing deferred is lost."""

    def work(session: BatchSession) -> None:
        session.execute(items.insert(), {"name": "a"})
        duplicate = session.execute(items.insert(), {"name": "a"})
        session.execute(items.insert(), {"name": "after"})
        with pytest.raises(IntegrityError):
            _ = duplicate.rowcount
        with pytest.raises(InvalidRequestError, match="failed") as again:
            _ = duplicate.rowcount
        assert isinstance(again.value.__cause__, IntegrityError)
        session.execute(items.insert(), {"name": "last"})

    in_session(engine, work)
    assert names(engine) == ["a", "after", "last"]


def test_a_savepoint_first_in_the_batch_is_still_inside_its_transaction(engine: sa.Engine) -> None:
    """SQLite: the sqlite3 module would open no transaction before a SAVEPOINT, so releasing it
    would commit on its own, apart from the batch's offsets. kstore's engine begins explicitly."""

    class SavepointFirst(Processor):
        def handle(self, msg: Message) -> None:
            with self.session.begin_nested():
                self.session.execute(items.insert(), {"name": "in a savepoint"})
            raise ValueError("the batch fails after the savepoint was released")

    with pytest.raises(ValueError):
        run_batch(SavepointFirst(), [make_message(b"x")], engine)
    assert names(engine) == [], "the released savepoint was rolled back with its batch"


# What the session relies on in SQLAlchemy (see the list at the top of kstore/db/session.py):
# these tests fail if an upgrade changes it.


@pytest.mark.parametrize("statement", [
    pytest.param(lambda: items.insert().returning(items.c.id), id="returning"),
    pytest.param(lambda: items.insert().return_defaults(), id="return_defaults"),
    pytest.param(lambda: items.insert().values([{"name": sa.bindparam("a")}, {"name": sa.bindparam("b")}]),
                 id="multi-row values"),
    pytest.param(lambda: items.insert().from_select(["name"], sa.select(sa.bindparam("a", type_=sa.String))),
                 id="from_select"),
    pytest.param(lambda: sa.insert(Item), id="ORM entity"),
])
def test_inserts_that_return_rows_or_write_several_run_at_once(
        engine: sa.Engine, statements: Any, statement: Any) -> None:
    def work(session: BatchSession) -> None:
        result = session.execute(statement(), {"name": "x", "a": "x", "b": "y"})
        assert not isinstance(result, DeferredResult)
        assert inserts(statements), "sent at once"

    in_session(engine, work)
    assert "x" in names(engine)


def test_orm_statements_take_the_orms_path(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        session.execute(items.insert(), {"name": "a"})
        (item,) = session.execute(sa.select(Item)).scalars()
        assert isinstance(item, Item) and item.name == "a", "ORM entities, not Core rows"

    in_session(engine, work)


def test_orm_changes_made_before_a_deferred_insert_go_first(engine: sa.Engine) -> None:
    """New, changed and deleted ORM objects are flushed before a one-row INSERT is deferred."""

    def work(session: BatchSession) -> None:
        renamed, gone = Item(name="a"), Item(name="gone")
        session.add_all([renamed, gone])
        session.flush()
        renamed.name = "renamed"
        session.execute(items.insert(), {"name": "a"})  # unique: fails unless the rename went first
        session.delete(gone)
        session.execute(items.insert(), {"name": "gone"})  # fails unless the delete went first
        session.add(Item(name="new"))
        session.execute(items.insert(), {"name": "last"})

    in_session(engine, work)
    assert sorted(names(engine)) == ["a", "gone", "last", "new", "renamed"]


def test_no_autoflush_and_inserts_made_while_flushing(engine: sa.Engine, statements: Any) -> None:
    def work(session: BatchSession) -> None:
        with session.no_autoflush:
            session.add(Item(name="orm"))
            session.execute(items.insert(), {"name": "core"})
            assert not inserts(statements), "no_autoflush: the ORM object waits, the INSERT is deferred"
        hooked: list[bool] = []

        @sa.event.listens_for(session, "before_flush")
        def insert_while_flushing(s: Any, context: Any, instances: Any) -> None:
            if not hooked:
                hooked.append(True)
                s.execute(items.insert(), {"name": "from a flush hook"})  # deferred, not a nested flush

        session.flush()

    in_session(engine, work)
    assert names(engine) == ["core", "orm", "from a flush hook"]


ROUTES: dict[str, Any] = {
    "execute a Core SELECT": lambda s, obj: s.execute(sa.select(items)).all(),
    "execute an ORM SELECT": lambda s, obj: s.execute(sa.select(Item)).all(),
    "scalar": lambda s, obj: s.scalar(sa.select(sa.func.count()).select_from(items)),
    "scalars": lambda s, obj: s.scalars(sa.select(items.c.name)).all(),
    "get": lambda s, obj: s.get(Item, 2),
    "query": lambda s, obj: s.query(Item).all(),
    "refresh": lambda s, obj: s.refresh(obj),
    "load an expired attribute": lambda s, obj: (s.expire(obj), obj.name),
    "connection": lambda s, obj: s.connection(),
    "flush": lambda s, obj: s.flush(),
    "flush an ORM object": lambda s, obj: (s.add(Item(name="orm")), s.flush()),
    "begin_nested": lambda s, obj: s.begin_nested(),
    "bulk_insert_mappings": lambda s, obj: s.bulk_insert_mappings(Item, [{"name": "bulk"}]),
    "bulk_save_objects": lambda s, obj: s.bulk_save_objects([Item(name="bulk")]),
    "bulk_update_mappings": lambda s, obj: s.bulk_update_mappings(Item, [{"id": 2, "kind": "bulk"}]),
}


@pytest.mark.parametrize("autoflush", [True, False], ids=["autoflush", "no autoflush"])
@pytest.mark.parametrize("route", ROUTES)
def test_every_way_to_the_database_sends_the_deferred_inserts_first(
        engine: sa.Engine, statements: Any, route: str, autoflush: bool) -> None:
    """With autoflush, SQLAlchemy's flush before a query would send them too; without, only the session does."""

    def work(session: BatchSession) -> None:
        obj = Item(name="first")
        session.add(obj)
        session.flush()
        session.autoflush = autoflush
        session.execute(items.insert(), {"name": "deferred"})
        before = len(statements)
        ROUTES[route](session, obj)
        assert statements[before:], "the deferred INSERT was sent"
        assert statements[before][0].startswith("INSERT INTO items"), statements[before:]

    in_session(engine, work)
    assert names(engine)[:2] == ["first", "deferred"]


def test_consecutive_inserts_of_equal_statements_are_merged(engine: sa.Engine, statements: Any) -> None:
    """SQLAlchemy's cache key tells equal statements apart from different ones."""

    def work(session: BatchSession) -> None:
        for i in range(3):
            session.execute(sa.insert(items).values(kind="k"), {"name": f"k{i}"})
        for i in range(3):
            session.execute(sa.insert(items).values(kind=sa.literal("x") + "y"), {"name": f"xy{i}"})

    in_session(engine, work)
    assert inserts(statements) == [(inserts(statements)[0][0], True), (inserts(statements)[1][0], True)]


def test_inserts_of_different_statements_with_the_same_parameters_are_not_merged(engine: sa.Engine) -> None:
    def work(session: BatchSession) -> None:
        session.execute(sa.insert(items), {"name": "a"})
        session.execute(sa.insert(items).prefix_with("OR IGNORE"), {"name": "a"})  # SQLite: skips the duplicate
        session.execute(sa.insert(items), {"name": "b"})

    in_session(engine, work)
    assert names(engine) == ["a", "b"]


def test_closing_the_session_in_handle_keeps_its_writes(tmp_path: Path) -> None:
    """The deferred INSERTs of a closed session used to be dropped: offsets moved, no rows."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'm.db'}")
    metadata.create_all(engine)
    run_batch(SessionMisuse(), [make_message("close-a", offset=0), make_message("close-b", offset=1),
                                make_message("plain", offset=2)], engine)
    with engine.connect() as conn:
        values = [r[0] for r in conn.execute(sa.text("SELECT value FROM effects ORDER BY kafka_offset"))]
    assert values == ["close-a", "close-b", "plain"]


def test_a_session_rollback_in_run_batch_is_refused_and_commits_no_part_of_the_batch(tmp_path: Path) -> None:
    """The rollback would have undone the earlier messages' writes while the later ones committed:
    it is refused, and the batch fails whole (nothing of it commits), where without the rollback
    the same batch commits every write."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'r.db'}")
    metadata.create_all(engine)
    msgs = [make_message("ok0", offset=0), make_message("ok1", offset=1), make_message("rollback", offset=2),
            make_message("ok2", offset=3)]
    with pytest.raises(BatchRollbackError, match=r"session.rollback\(\) inside a batch would undo"):
        run_batch(SessionMisuse(), msgs, engine)
    assert values(engine) == []  # nothing, not a part
    run_batch(SessionMisuse(), [m for m in msgs if m.value != "rollback"], engine)
    assert values(engine) == ["ok0", "ok1", "ok2"]


def values(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text("SELECT value FROM effects ORDER BY kafka_offset"))]
