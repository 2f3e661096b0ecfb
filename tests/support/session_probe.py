"""Run by tests/integration/harness/test_parallel_sessions.py in pytest sessions of their own (not collected by the
suite: the name does not start with ``test_``). Each kstore session checks that its PostgreSQL
still answers, a CHECKPOINT included (it rewrites ``global/pg_control``), after the other sessions
have started; a foreign session (another project's, no kstore conftest) only makes its own base temp.
The sessions meet through marker files in ``KSTORE_PROBE_DIR``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psycopg2

from tests.support.harness import wait_until

PROBE_DIR = Path(os.environ.get("KSTORE_PROBE_DIR", "."))
NAME = os.environ.get("KSTORE_PROBE_NAME", "")
#: The sessions this one waits for before it checks its server again.
OTHERS = [n for n in os.environ.get("KSTORE_PROBE_OTHERS", "").split(",") if n]


def _checkpoint(postgresql: Any) -> int:
    info = postgresql.info
    with psycopg2.connect(host=info.host, port=info.port, user=info.user, dbname=info.dbname) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CHECKPOINT")
            cur.execute("SELECT count(*) FROM pg_class")
            return int(cur.fetchone()[0])


def test_the_database_outlives_the_other_sessions_start(postgresql: Any) -> None:
    assert _checkpoint(postgresql) > 0
    (PROBE_DIR / f"{NAME}.up").touch()
    wait_until(lambda: all((PROBE_DIR / f"{o}.up").exists() for o in OTHERS), timeout=300,
               what=f"the sessions {OTHERS} to start")
    assert _checkpoint(postgresql) > 0
    (PROBE_DIR / f"{NAME}.checked").touch()
    # Keep this server running until every session has checked its own.
    wait_until(lambda: all((PROBE_DIR / f"{o}.checked").exists() for o in OTHERS), timeout=300,
               what=f"the sessions {OTHERS} to check their servers")
