"""The WAL transport's write on real PostgreSQL, on both drivers: records emitted in a transaction
are decoded from a logical replication slot (pgoutput, ``messages 'true'``) exactly as written, a
transaction's messages together and in order, transactions in commit order; nothing of a rolled-back
transaction or savepoint is ever decoded; a batch over the bound arrives as several messages of one
transaction. The slot is read with ``pg_logical_slot_get_binary_changes`` and pgoutput's messages
parsed here, so the write is checked against the server's own protocol."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.store import make_engine
from kstore.relay.wal.emit import WalUnavailableError, emit
from kstore.relay.wal.framing import decode, encode
from kstore.types import Produced
from tests.support.harness import with_driver

pytestmark = pytest.mark.integration

PREFIX = "kstore.outbox:group:orders"


@dataclass
class Decoded:
    """One decoded transaction: its xid and its kstore messages' contents, in order."""

    xid: int
    contents: list[bytes] = field(default_factory=list)

    def records(self) -> list[Produced]:
        return [r for c in self.contents for r in decode(c)]


@dataclass
class Slot:
    """A logical replication slot on pgoutput and its empty publication, read by SQL."""

    engine: sa.Engine
    name: str

    def take(self, prefix: str = PREFIX) -> list[Decoded]:
        """The transactions committed since the last take that carry messages under ``prefix``."""
        # The publication shares the slot's name, bound twice: psycopg 3 binds on the server, which
        # would type one parameter as both a slot name and text.
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT data FROM pg_logical_slot_get_binary_changes(:slot, NULL, NULL, "
                "'proto_version', '1', 'publication_names', :pub, 'messages', 'true')"),
                {"slot": self.name, "pub": self.name}).scalars().all()
        transactions: list[Decoded] = []
        current: Decoded | None = None
        for data in rows:
            data = bytes(data)
            kind = data[:1]
            if kind == b"B":  # Begin: final LSN, commit timestamp, xid.
                current = Decoded(struct.unpack_from(">QqI", data, 1)[2])
            elif kind == b"M":  # Message: flags, LSN, prefix (NUL-terminated), length, content.
                flags = data[1]
                end = data.index(b"\0", 10)
                message_prefix = data[10:end].decode()
                (length,) = struct.unpack_from(">i", data, end + 1)
                content = data[end + 5:end + 5 + length]
                assert len(content) == length
                if message_prefix == prefix:
                    assert flags == 1, "kstore's messages are transactional"
                    assert current is not None, "a transactional message is decoded inside its transaction"
                    current.contents.append(content)
            elif kind == b"C":
                assert current is not None
                if current.contents:
                    transactions.append(current)
                current = None
        return transactions


@pytest.fixture(params=["psycopg2", "psycopg"])
def engine(request: Any, pg_dsn: str) -> Iterator[sa.Engine]:
    e = make_engine(Settings(dsn=with_driver(pg_dsn, request.param)))
    yield e
    e.dispose()


@pytest.fixture
def slot(pg_dsn: str) -> Iterator[Slot]:
    # Its own engine, on autocommit: a slot is made outside any transaction that wrote.
    admin = sa.create_engine(pg_dsn, isolation_level="AUTOCOMMIT")
    name = f"kstore_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE PUBLICATION {name}"))
        conn.execute(sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": name})
    try:
        yield Slot(admin, name)
    finally:
        # A database with a slot cannot be dropped: the fixture's server drops it after the test.
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_drop_replication_slot(:s)"), {"s": name})
            conn.execute(sa.text(f"DROP PUBLICATION {name}"))
        admin.dispose()


def batch(tag: str, n: int = 3) -> list[Produced]:
    return [Produced(f"out-{tag}", f"{tag}-{i}".encode(), None if i % 2 else f"k{i}".encode(),
                     (("trace", tag.encode()), ("none", None)), None if i % 3 else i) for i in range(n)]


def test_a_committed_transactions_records_come_back_identically(engine: sa.Engine, slot: Slot) -> None:
    records = [*batch("a"), Produced("ünï-😀", b"", b"", (("é", b""),), 0)]
    with engine.begin() as conn:
        assert emit(conn, PREFIX, records) == 1
        xid = conn.execute(sa.text("SELECT txid_current()")).scalar_one()
    [decoded] = slot.take()
    assert decoded.records() == records
    assert decoded.xid == xid % 2**32
    assert slot.take() == [], "a slot gives a transaction once"


def test_transactions_come_back_in_commit_order_not_write_order(engine: sa.Engine, slot: Slot) -> None:
    first, second, third = batch("first"), batch("second"), batch("third")
    with engine.connect() as a, engine.connect() as b, engine.connect() as c:
        a.begin(), b.begin(), c.begin()
        emit(a, PREFIX, first)
        emit(b, PREFIX, second)
        emit(c, PREFIX, third)
        c.commit()
        a.commit()
        b.commit()
    assert [t.records() for t in slot.take()] == [third, first, second]


def test_a_rolled_back_transaction_is_never_decoded(engine: sa.Engine, slot: Slot) -> None:
    with engine.connect() as conn:
        with conn.begin() as tx:
            emit(conn, PREFIX, batch("lost"))
            tx.rollback()
        with conn.begin():
            emit(conn, PREFIX, batch("kept"))
    assert [t.records() for t in slot.take()] == [batch("kept")]


def test_a_rolled_back_savepoint_drops_its_records_and_only_its(engine: sa.Engine, slot: Slot) -> None:
    with engine.begin() as conn:
        emit(conn, PREFIX, batch("before"))
        savepoint = conn.begin_nested()
        emit(conn, PREFIX, batch("savepoint"))
        savepoint.rollback()
        with conn.begin_nested():
            emit(conn, PREFIX, batch("released"))
        emit(conn, PREFIX, batch("after"))
    [decoded] = slot.take()
    assert decoded.records() == batch("before") + batch("released") + batch("after")


def test_a_batch_over_the_bound_arrives_as_several_messages_of_one_transaction(
        engine: sa.Engine, slot: Slot) -> None:
    records = [Produced("big", bytes([i]) * 1000, str(i).encode()) for i in range(25)]
    bound = 4 * 1024
    expected = encode(records, bound)
    assert len(expected) > 5
    with engine.begin() as conn:
        assert emit(conn, PREFIX, records, bound) == len(expected)
    [decoded] = slot.take()
    assert decoded.contents == expected
    assert decoded.records() == records


def test_no_records_write_nothing_and_each_outbox_has_its_prefix(engine: sa.Engine, slot: Slot) -> None:
    with engine.begin() as conn:
        assert emit(conn, PREFIX, []) == 0
        emit(conn, "kstore.outbox:app:web", batch("web"))
    # Read without consuming, so both prefixes look at the same transaction.
    with slot.engine.connect() as conn:
        kinds = conn.execute(sa.text(
            "SELECT substr(data, 1, 1) FROM pg_logical_slot_peek_binary_changes(:slot, NULL, NULL, "
            "'proto_version', '1', 'publication_names', :pub, 'messages', 'true')"),
            {"slot": slot.name, "pub": slot.name}).scalars().all()
    assert [bytes(k) for k in kinds] == [b"B", b"M", b"C"], "one message, the web outbox's"
    assert [t.records() for t in slot.take("kstore.outbox:app:web")] == [batch("web")]


def test_a_database_that_is_not_postgresql_is_refused(tmp_path: Any) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'kstore.db'}")
    try:
        with engine.begin() as conn, pytest.raises(WalUnavailableError, match="sqlite"):
            emit(conn, PREFIX, batch("x"))
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_server_that_does_not_decode_its_wal_is_refused_and_the_transaction_with_it(
        pg_outage_dsn: str, driver: str) -> None:
    # The outage test's server runs on PostgreSQL's default wal_level (replica).
    engine = make_engine(Settings(dsn=with_driver(pg_outage_dsn, driver)))
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW wal_level")).scalar_one() != "logical"
            conn.rollback()
            with pytest.raises(WalUnavailableError, match="wal_level=logical"), conn.begin():
                emit(conn, PREFIX, batch("x"))
            assert not conn.in_transaction()
    finally:
        engine.dispose()
