"""The WAL transport's read side on real PostgreSQL (started with ``wal_level=logical``): the
outbox's slot and publication are set up idempotently and checked with one-line errors; a streaming
reader gives committed transactions in commit order, never a rolled-back one, only its prefix's;
it resumes after what it confirmed and only that; the slot admits one reader; a cut connection
raises and a new reader resumes; the slot's retained WAL grows while unread and falls after a
confirm. (A server without ``wal_level=logical`` is not started here: that check's decision is
tested on facts rows in tests/unit/db/test_replication.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest

from kstore.db.replication import (
    ReplicationError,
    SlotInUse,
    Transaction,
    WalReader,
    check_server,
    drop_slot,
    setup_slot,
    slot_name,
    slot_state,
)
from tests.support.harness import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def dsn(postgresql: Any) -> str:
    info = postgresql.info
    return f"host={info.host} port={info.port} user={info.user} dbname={info.dbname}"


@pytest.fixture
def outbox(dsn: str) -> Iterator[str]:
    """A fresh outbox identity (its prefix) with its slot set up; dropped after the test, since a
    slot outlives its database and would keep the server from dropping it."""
    identity = f"kstore.outbox:group:orders-{uuid.uuid4().hex[:8]}"
    setup_slot(dsn, identity)
    yield identity
    wait_until(lambda: _try_drop(dsn, identity), timeout=30, what="the slot to be free to drop")


def _try_drop(dsn: str, identity: str) -> bool:
    try:
        drop_slot(dsn, identity)
    except SlotInUse:
        return False
    return True


@pytest.fixture
def sql(dsn: str) -> Iterator[Callable[[], Any]]:
    """New autocommit-off psycopg2 connections to the test database, closed after the test."""
    conns: list[Any] = []

    def connect() -> Any:
        conn = psycopg2.connect(dsn)
        conns.append(conn)
        return conn

    yield connect
    for conn in conns:
        conn.close()


def emit(conn: Any, prefix: str, content: bytes) -> None:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_logical_emit_message(true, %s, %s)", (prefix, content))


def commit_one(connect: Callable[[], Any], prefix: str, *contents: bytes) -> None:
    conn = connect()
    for content in contents:
        emit(conn, prefix, content)
    conn.commit()


def read(reader: WalReader, count: int, timeout: float = 10.0) -> list[Transaction]:
    got: list[Transaction] = []
    while len(got) < count:
        transaction = reader.next_transaction(timeout)
        assert transaction is not None, f"only {len(got)} of {count} transactions came"
        got.append(transaction)
    return got


def test_setup_creates_slot_and_publication_once(dsn: str, outbox: str, sql: Callable[[], Any]) -> None:
    assert setup_slot(dsn, outbox) == slot_name(outbox)
    setup_slot(dsn, outbox)
    with sql().cursor() as cur:
        cur.execute("SELECT plugin, slot_type FROM pg_replication_slots WHERE slot_name = %s", (slot_name(outbox),))
        assert cur.fetchall() == [("pgoutput", "logical")]
        cur.execute("SELECT puballtables, (SELECT count(*) FROM pg_publication_tables t WHERE t.pubname = p.pubname) "
                    "FROM pg_publication p WHERE pubname = %s", (slot_name(outbox),))
        assert cur.fetchall() == [(False, 0)]
    state = slot_state(dsn, outbox)
    assert state.wal_status == "reserved" and state.active_pid is None and state.confirmed_flush_lsn > 0


def test_a_role_without_replication_gets_one_line_naming_the_fix(dsn: str, sql: Callable[[], Any]) -> None:
    role = f"noreplication_{uuid.uuid4().hex[:8]}"
    conn = sql()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE ROLE {role} LOGIN NOREPLICATION")
    try:
        with pytest.raises(ReplicationError) as raised:
            check_server(" ".join(f"user={role}" if part.startswith("user=") else part for part in dsn.split()),
                         "kstore.outbox:app:x")
        assert "REPLICATION" in str(raised.value) and "\n" not in str(raised.value)
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP ROLE {role}")


def test_reader_gives_committed_transactions_in_commit_order_of_its_prefix_only(
        dsn: str, outbox: str, sql: Callable[[], Any]) -> None:
    first, second, rolled_back = sql(), sql(), sql()
    # Begun in one order, committed in the other: commit order is what counts.
    emit(first, outbox, b"first-1")
    emit(second, outbox, b"second-1")
    emit(rolled_back, outbox, b"never")
    emit(first, outbox, b"first-2")
    second.commit()
    rolled_back.rollback()
    commit_one(sql, "kstore.outbox:app:someone-else", b"other")
    first.commit()
    commit_one(sql, outbox, b"last")
    with WalReader.open(dsn, outbox, outbox) as reader:
        got = read(reader, 3)
        assert [t.messages for t in got] == [[b"second-1"], [b"first-1", b"first-2"], [b"last"]]
        assert got[0].commit_lsn < got[1].commit_lsn < got[2].commit_lsn
        assert reader.next_transaction(1.0) is None


def test_a_new_reader_starts_after_the_confirmed_transaction_and_only_that(
        dsn: str, outbox: str, sql: Callable[[], Any]) -> None:
    for content in (b"a", b"b", b"c"):
        commit_one(sql, outbox, content)
    with WalReader.open(dsn, outbox, outbox) as reader:
        assert [t.messages for t in read(reader, 3)] == [[b"a"], [b"b"], [b"c"]]
    # Nothing confirmed: everything again.
    with WalReader.open(dsn, outbox, outbox) as reader:
        got = read(reader, 3)
        assert [t.messages for t in got] == [[b"a"], [b"b"], [b"c"]]
        reader.confirm(got[0].end_lsn)
    with WalReader.open(dsn, outbox, outbox) as reader:
        assert [t.messages for t in read(reader, 2)] == [[b"b"], [b"c"]]
        assert reader.next_transaction(1.0) is None


def test_a_second_reader_of_the_slot_gets_slot_in_use(dsn: str, outbox: str) -> None:
    with WalReader.open(dsn, outbox, outbox) as reader:
        reader.next_transaction(0.1)
        with pytest.raises(SlotInUse, match=slot_name(outbox)):
            WalReader.open(dsn, outbox, outbox)
    # Once the first one has gone, the slot can be read again.
    wait_until(lambda: slot_state(dsn, outbox).active_pid is None, what="the slot to be released")
    WalReader.open(dsn, outbox, outbox).close()


def test_a_cut_connection_raises_and_a_new_reader_resumes_from_the_confirmed_point(
        dsn: str, outbox: str, sql: Callable[[], Any]) -> None:
    commit_one(sql, outbox, b"a")
    commit_one(sql, outbox, b"b")
    reader = WalReader.open(dsn, outbox, outbox)
    try:
        got = read(reader, 2)
        reader.confirm(got[0].end_lsn)
        pid = wait_until(lambda: slot_state(dsn, outbox).active_pid, what="the walsender's pid")
        conn = sql()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(ReplicationError, match="connection broke"):
            for _ in range(20):
                reader.next_transaction(0.5)
    finally:
        reader.close()
    wait_until(lambda: slot_state(dsn, outbox).active_pid is None, what="the slot to be released")
    with WalReader.open(dsn, outbox, outbox) as again:
        assert [t.messages for t in read(again, 1)] == [[b"b"]]


def test_retained_wal_grows_while_unread_and_falls_after_confirm(
        dsn: str, outbox: str, sql: Callable[[], Any]) -> None:
    before = slot_state(dsn, outbox).retained_bytes
    for _ in range(8):
        commit_one(sql, outbox, b"x" * 256 * 1024)
    grown = slot_state(dsn, outbox).retained_bytes
    assert grown >= before + 2 * 1024 * 1024
    with WalReader.open(dsn, outbox, outbox) as reader:
        got = read(reader, 8)
        reader.confirm(got[-1].end_lsn)
        conn = sql()
        conn.autocommit = True

        def fell() -> bool:
            # A checkpoint logs the running transactions, from which the walsender moves the slot's
            # restart point up to what was confirmed.
            with conn.cursor() as cur:
                cur.execute("CHECKPOINT")
            reader.next_transaction(0.5)
            return slot_state(dsn, outbox).retained_bytes < grown // 2

        wait_until(fell, timeout=30, what="the slot's retained WAL to fall")
