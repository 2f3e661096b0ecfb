"""kstore's PostgreSQL connections and silence: TCP keepalives (5 s idle, 3 probes 2 s apart) and
``tcp_user_timeout`` (= ``KSTORE_DB_TIMEOUT_S``) reach libpq, read back from the connection's own
socket; ``KSTORE_DB_TIMEOUT_S=0`` turns the deadline off, so a long statement in a real
`kstore worker` is not cut (and with a deadline, the same statement is)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.store import make_engine
from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until, with_driver

DRIVERS = ["psycopg2", "psycopg"]
CUT = "a database round trip got no answer within its deadline: cutting the connection"
SLOW = "contract_processors:Slow"


def socket_options(engine: sa.Engine) -> dict[str, int]:
    """The TCP options of one of the engine's connections, read from its socket."""
    raw = engine.raw_connection()
    try:
        fd = raw.driver_connection.fileno()  # type: ignore[union-attr]
        with socket.socket(fileno=os.dup(fd)) as sock:
            assert sock.family in (socket.AF_INET, socket.AF_INET6), "the test database must be reached over TCP"
            return {
                "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                "count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            }
    finally:
        raw.close()


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(("timeout_s", "user_timeout_ms"), [(30.0, 30_000), (7.5, 7_500), (0.0, 0)])
def test_keepalives_and_tcp_user_timeout_reach_the_connections_socket(
    pg_dsn: str, driver: str, timeout_s: float, user_timeout_ms: int,
) -> None:
    engine = make_engine(Settings(dsn=with_driver(pg_dsn, driver), db_timeout_s=timeout_s))
    try:
        assert socket_options(engine) == {"keepalive": 1, "idle": 5, "interval": 2, "count": 3,
                                          "user_timeout_ms": user_timeout_ms}
    finally:
        engine.dispose()


def run_stalling(dsn: str, topic: str, produce: Callable[..., Any], workers: Callable[..., Any],
                 timeout_s: str) -> Any:
    """A worker whose message "stall" runs ``pg_sleep(3)`` inside its batch."""
    produce(topic, ["a", "stall", "b"], partition=0)
    return workers(dsn, topic, "no-deadline", SLOW, args=["--on-error", "dead_letter", "--max-attempts", "1"],
                   env={"KSTORE_DB_TIMEOUT_S": timeout_s, "KSTORE_TEST_STALL": "statement",
                        "KSTORE_TEST_STALL_S": "3", "KSTORE_TEST_STALL_VALUE": "stall"})


def test_db_timeout_0_turns_the_deadline_off_and_a_long_statement_runs_to_its_end(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=1)
    w = run_stalling(pg_dsn, topic, produce, workers, "0")
    wait_until(lambda: stored_offsets(pg_dsn, "no-deadline").get((topic, 0)) == 3, 60, what="offset 3 stored")
    assert w.terminate() == 0
    assert CUT not in w.log and "database error" not in w.log and "dead-lettered" not in w.log
    assert_exactly_once(effects(pg_dsn), {(topic, 0, o) for o in range(3)})


def test_a_db_timeout_cuts_the_same_long_statement(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    """The contrast that shows the test above tests something: a 1 s deadline cuts the 3 s statement."""
    topic = new_topic(partitions=1)
    w = run_stalling(pg_dsn, topic, produce, workers, "1")
    w.wait_for_log(CUT, timeout=60)
    assert w.terminate() == 0
