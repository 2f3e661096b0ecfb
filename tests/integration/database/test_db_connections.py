"""kstore's database connections on a real PostgreSQL: what they keep of the DSN, how a real error
is classed, how a commit in doubt is read back. The classes by SQLSTATE alone and the deadline
watchdog's memory: tests/unit/db/test_sqlerrors.py and tests/unit/db/test_deadline.py."""

from __future__ import annotations

import threading
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.sqlerrors import transient
from kstore.db.store import Store, make_engine
from tests.support.harness import stored_offsets, wait_until, with_driver

DRIVERS = ["psycopg2", "psycopg"]


def _show(engine: sa.Engine, name: str) -> str:
    with engine.connect() as conn:
        return str(conn.exec_driver_sql(f"SHOW {name}").scalar_one())


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_dsns_own_server_options_are_kept_beside_kstores(pg_dsn: str, driver: str) -> None:
    """kstore's connection argument ``options`` (its idle-in-transaction timeout) used to replace the
    DSN's ``options=``: a ``search_path`` or ``statement_timeout`` there was silently dropped."""
    url = sa.engine.make_url(with_driver(pg_dsn, driver)).update_query_dict(
        {"options": "-c search_path=elsewhere,public -c statement_timeout=4321"})
    engine = make_engine(Settings(dsn=url.render_as_string(hide_password=False), idle_in_transaction_timeout_ms=7654))
    try:
        assert _show(engine, "search_path") == "elsewhere,public"
        assert _show(engine, "statement_timeout") == "4321ms"
        assert _show(engine, "idle_in_transaction_session_timeout") == "7654ms"
    finally:
        engine.dispose()


def test_pgoptions_are_kept_when_the_dsn_has_none(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """libpq reads ``PGOPTIONS`` only when no ``options`` argument is given, and kstore always gives one."""
    monkeypatch.setenv("PGOPTIONS", "-c search_path=fromenv,public")
    engine = make_engine(Settings(dsn=pg_dsn))
    try:
        assert _show(engine, "search_path") == "fromenv,public"
        assert _show(engine, "idle_in_transaction_session_timeout") == "10s"
    finally:
        engine.dispose()


def test_a_real_read_only_transaction_is_transient(pg_dsn: str) -> None:
    engine = make_engine(Settings(dsn=pg_dsn))
    try:
        with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as raised:
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            conn.exec_driver_sql("CREATE TABLE nope (a int)")
        assert transient(raised.value)
    finally:
        engine.dispose()


def test_a_commit_in_doubt_is_read_back_after_the_transaction_still_holding_its_rows(pg_dsn: str) -> None:
    """A COMMIT cut by the deadline may still be running on the server when the worker reads its
    rows back; a plain read then sees the old row and calls it "did not land". The batch's read back
    waits for the rows' locks and sees what that transaction did."""
    settings = Settings(dsn=pg_dsn)
    engine = make_engine(settings)
    store = Store(engine, settings)
    tp = ("t", 0)
    with store.claiming("g", [tp], "me") as (conn, claims):
        store.start_at(conn, "g", tp, 0, claims[tp].epoch, "test", None)
    raw = psycopg2.connect(sa.engine.make_url(with_driver(pg_dsn, "psycopg2")).set(drivername="postgresql")
                           .render_as_string(hide_password=False))
    try:
        cur = raw.cursor()
        cur.execute("UPDATE kstore_offsets SET next_offset = 7 WHERE consumer_group = 'g'")  # holds the lock
        plain = store.rows("g", partitions=[tp])[tp].next_offset
        read: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: read.update(store.rows("g", partitions=[tp], wait_for_locks=True)))
        reader.start()
        # The read back is waiting for the lock (not answering from the old row) before the holder commits.
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%FOR SHARE%'"
        wait_until(lambda: _count(raw, waiting) == 1, 30, what="the read back waiting for the row's lock")
        raw.commit()
        reader.join(30)
        assert plain == 0
        assert read[tp].next_offset == 7
        assert stored_offsets(pg_dsn, "g") == {tp: 7}
    finally:
        raw.close()
        engine.dispose()


def _count(raw: Any, sql: str) -> int:
    with psycopg2.connect(raw.dsn) as other, other.cursor() as cur:
        cur.execute(sql)
        return int(cur.fetchone()[0])


