"""The fault-injecting proxy, against the real PostgreSQL: each fault does what the integration tests rely on."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.support.faultproxy import FaultProxy
from tests.support.harness import wait_until

pytestmark = pytest.mark.integration

INSERT = sa.text("INSERT INTO fp_rows (id) VALUES (:id)")


@pytest.fixture
def direct(pg_dsn: str) -> Iterator[sa.Engine]:
    """An engine straight to the server, with the proxy tests' table and a sequence."""
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE fp_rows (id integer PRIMARY KEY)"))
        conn.execute(sa.text("CREATE SEQUENCE fp_seq"))
    yield engine
    engine.dispose()


@pytest.fixture
def make_proxy(pg_dsn: str) -> Iterator[Callable[..., FaultProxy]]:
    started: list[FaultProxy] = []

    def make(**kwargs: Any) -> FaultProxy:
        url = make_url(pg_dsn)
        proxy = FaultProxy(url.host or "127.0.0.1", url.port or 5432, **kwargs).start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()
        print("\n".join(proxy.events))  # shown when the test failed


@pytest.fixture
def proxy(make_proxy: Callable[..., FaultProxy]) -> FaultProxy:
    return make_proxy()


@pytest.fixture
def proxied(pg_dsn: str, proxy: FaultProxy, direct: sa.Engine) -> Iterator[sa.Engine]:
    """An engine through ``proxy``, already connected once (SQLAlchemy's first-connect queries are done)."""
    engine = sa.create_engine(proxy.dsn_through(pg_dsn), pool_size=10)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    yield engine
    engine.dispose()


def rows(engine: sa.Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT id FROM fp_rows")).scalars())


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``fn`` in a daemon thread; the dict gets its "result" or "error"."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn()
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_forwards_transactions_from_many_connections(proxied: sa.Engine, proxy: FaultProxy,
                                                     direct: sa.Engine) -> None:
    def transaction(i: int) -> None:
        with proxied.begin() as conn:
            conn.execute(INSERT, {"id": i})
            conn.execute(sa.text("SELECT pg_sleep(0.2)"))  # so that the transactions overlap

    threads = [run_in_thread(functools.partial(transaction, i)) for i in range(8)]
    for thread, outcome in threads:
        thread.join(10)
        assert "error" not in outcome and not thread.is_alive()
    assert rows(direct) == rows(proxied) == set(range(8))
    assert proxy.connections_seen >= 8, "the engine did not go through the proxy"
    assert proxy.cuts == 0


def test_dsn_through_points_at_the_proxy(pg_dsn: str, proxy: FaultProxy) -> None:
    url = make_url(proxy.dsn_through(pg_dsn))
    assert (url.host, url.port) == ("127.0.0.1", proxy.port)
    assert proxy.address == f"127.0.0.1:{proxy.port}"
    assert url.database == make_url(pg_dsn).database and url.drivername == make_url(pg_dsn).drivername


@pytest.mark.parametrize("sslmode", ["prefer", "disable"])
@pytest.mark.parametrize("recv_size", [65536, 1], ids=["whole", "byte-by-byte"])
def test_cut_after_commit_leaves_a_commit_in_doubt(pg_dsn: str, direct: sa.Engine,
                                                   make_proxy: Callable[..., FaultProxy],
                                                   sslmode: str, recv_size: int) -> None:
    """The client's commit() fails, yet the row is there: the commit landed and only its answer was lost.

    With sslmode=prefer psycopg2 starts with an SSLRequest (answered by one untyped byte); byte-by-byte
    forwarding splits every message, so the framing is exercised against the real server's traffic."""
    proxy = make_proxy(recv_size=recv_size)
    engine = sa.create_engine(proxy.dsn_through(pg_dsn), connect_args={"sslmode": sslmode})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        proxy.cut_after_commit()
        conn = engine.connect()
        conn.execute(INSERT, {"id": 1})
        with pytest.raises(sa.exc.OperationalError):
            conn.commit()
        conn.close()
        assert rows(direct) == {1}, "the COMMIT did not reach the server before the cut"
        assert (proxy.commits_cut, proxy.cuts) == (1, 1)
        assert any("SSLRequest" in e for e in proxy.events) == (sslmode == "prefer")

        with engine.begin() as conn:  # armed for one commit only
            conn.execute(INSERT, {"id": 2})
        assert rows(direct) == {1, 2}
        assert proxy.commits_cut == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize("recv_size", [65536, 1], ids=["whole", "byte-by-byte"])
def test_cut_before_commit_leaves_a_commit_in_doubt_that_did_not_land(
        pg_dsn: str, direct: sa.Engine, make_proxy: Callable[..., FaultProxy], recv_size: int) -> None:
    """The client's commit() fails as after a lost answer, and the row is not there: the COMMIT never
    reached the server, which rolled the transaction back. A one-message "...; COMMIT" is refused too."""
    proxy = make_proxy(recv_size=recv_size)
    engine = sa.create_engine(proxy.dsn_through(pg_dsn), connect_args={"sslmode": "disable"})
    try:
        proxy.cut_before_commit(2)
        conn = engine.connect()
        conn.execute(INSERT, {"id": 1})
        with pytest.raises(sa.exc.OperationalError):
            conn.commit()
        conn.close()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, \
                pytest.raises(sa.exc.OperationalError):
            conn.exec_driver_sql("BEGIN; INSERT INTO fp_rows (id) VALUES (2); COMMIT")
        assert rows(direct) == set(), "a refused COMMIT reached the server"
        assert (proxy.commits_refused, proxy.commits_cut, proxy.cuts) == (2, 0, 2)
        assert any("INSERT" in sql for sql in proxy.refused_transactions[0])

        with engine.begin() as conn:  # armed for two commits only
            conn.execute(INSERT, {"id": 3})
        assert rows(direct) == {3}
    finally:
        engine.dispose()


def test_cut_mid_transaction_runs_the_statement_then_rolls_back(proxied: sa.Engine, proxy: FaultProxy,
                                                                 direct: sa.Engine) -> None:
    proxy.cut_mid_transaction()
    with proxied.connect() as conn, pytest.raises(sa.exc.OperationalError):
        conn.execute(sa.text("INSERT INTO fp_rows (id) VALUES (nextval('fp_seq'))"))
    assert rows(direct) == set()
    with direct.connect() as conn:  # sequences ignore rollbacks: the statement did run on the server
        assert conn.execute(sa.text("SELECT is_called FROM fp_seq")).scalar() is True
    assert (proxy.transactions_cut, proxy.cuts, proxy.commits_cut) == (1, 1, 0)

    with proxied.begin() as conn:  # armed once only
        conn.execute(INSERT, {"id": 7})
    assert rows(direct) == {7}


def test_a_commit_whose_client_gave_up_before_the_answer_leaves_its_fault_armed(
        proxied: sa.Engine, proxy: FaultProxy, direct: sa.Engine) -> None:
    """A COMMIT that takes the armed cut but whose client closes its socket before the answer (its
    deadline cut it, say, while the proxy held the bytes) cuts no answer: the fault stays armed for
    the next COMMIT, so a test waiting for N cut answers gets N."""
    proxy.latency(1.0)
    stale = proxied.raw_connection()
    cursor = stale.cursor()
    cursor.execute("INSERT INTO fp_rows (id) VALUES (1)")
    before = proxy.client_bytes
    committing, outcome = run_in_thread(stale.commit)
    wait_until(lambda: proxy.client_bytes > before, 10, interval=0.005, what="the COMMIT at the proxy")
    # The client gives up: its socket closes while the proxy still holds the COMMIT for the latency.
    socket.socket(fileno=os.dup(stale.driver_connection.fileno())).shutdown(socket.SHUT_RDWR)
    proxy.cut_after_commit()
    committing.join(10)
    assert "error" in outcome
    wait_until(lambda: any("closed by the client" in e for e in proxy.events), 10, what="the stale connection closed")
    assert proxy.commits_cut == 0
    proxy.latency(0)
    conn = proxied.connect()
    conn.execute(INSERT, {"id": 2})
    with pytest.raises(sa.exc.OperationalError):
        conn.commit()
    conn.close()
    assert proxy.commits_cut == 1
    assert 2 in rows(direct)
    stale.invalidate()


def test_blackhole_holds_traffic_until_heal(proxied: sa.Engine, proxy: FaultProxy) -> None:
    """Nothing gets through, not even a new connection; heal() delivers what the proxy held, drops nothing."""
    conn = proxied.connect().execution_options(isolation_level="AUTOCOMMIT")
    conn.execute(sa.text("SELECT 1"))
    proxy.latency(0.3)
    before = proxy.client_bytes
    query, query_outcome = run_in_thread(lambda: conn.execute(sa.text("SELECT 41 + 1")).scalar())
    # The query has reached the proxy, which holds it for the latency: then the blackhole.
    wait_until(lambda: proxy.client_bytes > before, 10, interval=0.005, what="the query at the proxy")
    proxy.blackhole()

    def new_connection() -> Any:
        with proxied.connect() as other:
            return other.execute(sa.text("SELECT 2")).scalar()

    connect, connect_outcome = run_in_thread(new_connection)
    query.join(1.5)
    connect.join(0.1)
    assert query.is_alive() and connect.is_alive(), (query_outcome, connect_outcome)

    proxy.latency(0)
    proxy.heal()
    query.join(10)
    connect.join(10)
    assert query_outcome == {"result": 42}
    assert connect_outcome == {"result": 2}
    assert proxy.cuts == 0
    conn.close()


def test_blackhole_for_heals_by_itself(proxied: sa.Engine, proxy: FaultProxy) -> None:
    with proxied.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("SELECT 1"))
        proxy.blackhole_for(0.8)
        started = time.monotonic()
        assert conn.execute(sa.text("SELECT 3")).scalar() == 3
        assert time.monotonic() - started >= 0.7


def test_latency_delays_each_way(proxied: sa.Engine, proxy: FaultProxy) -> None:
    def round_trip(conn: sa.Connection) -> float:
        started = time.monotonic()
        conn.execute(sa.text("SELECT 1"))
        return time.monotonic() - started

    with proxied.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        proxy.latency(0.25)
        assert round_trip(conn) >= 0.5  # 0.25 s there and 0.25 s back
        proxy.latency(0)
        # Without it, well under the delayed round trip (a bound a loaded machine meets).
        assert round_trip(conn) < 0.5


def test_cut_all_resets_every_connection(proxied: sa.Engine, proxy: FaultProxy) -> None:
    conns = [proxied.connect() for _ in range(3)]
    for conn in conns:
        conn.execute(sa.text("SELECT 1"))
    assert proxy.open_connections == 3

    assert proxy.cut_all() == 3
    assert proxy.open_connections == 0 and proxy.cuts == 3
    for conn in conns:
        with pytest.raises(sa.exc.OperationalError):
            conn.execute(sa.text("SELECT 1"))
        conn.close()
    with proxied.connect() as conn:
        assert conn.execute(sa.text("SELECT 5")).scalar() == 5


def test_raw_protocol_forwards_but_refuses_protocol_faults(pg_dsn: str, direct: sa.Engine,
                                                           make_proxy: Callable[..., FaultProxy]) -> None:
    """protocol="raw" (for Kafka) moves bytes without reading them: commit and transaction cuts are refused."""
    proxy = make_proxy(protocol="raw")
    with pytest.raises(ValueError):
        proxy.cut_after_commit()
    with pytest.raises(ValueError):
        proxy.cut_mid_transaction()
    engine = sa.create_engine(proxy.dsn_through(pg_dsn))
    try:
        with engine.begin() as conn:
            conn.execute(INSERT, {"id": 3})
        assert rows(direct) == {3}
        assert proxy.connections_seen == 1
        assert proxy.cut_all() == 1  # the pooled connection
    finally:
        engine.dispose()
