"""The web console through Starlette's test client, on a SQLite database with seven dead letters
of group ``orders`` and one stored offset: what the console's unit tests share."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa
from starlette.testclient import TestClient

from kstore import Settings, migrate
from kstore.console import app
from kstore.db import deadletters
from kstore.db.store import Store, make_engine
from kstore.db.writes import now

PASSWORD = "c0nsole-Pa55"
GROUP = "orders"


def add_letter(conn: sa.Connection, table: sa.Table, n: int, error: str) -> None:
    now = datetime.now(timezone.utc)
    conn.execute(table.insert().values(
        consumer_group=GROUP, topic="t", partition_id=n % 2, offset=n, key=None, value=f"v{n}".encode(),
        headers="[]", timestamp=now, error=error, traceback="Traceback ...", attempts=2, first_failure_at=now,
        last_failure_at=now, status=deadletters.DEAD))


def seeded_dsn(tmp_path: Path, file: str = "kstore.db") -> str:
    dsn = f"sqlite:///{tmp_path / file}"
    settings = Settings(dsn=dsn)
    migrate(settings)
    engine = make_engine(settings)
    table = deadletters.build_table()
    with engine.begin() as conn:
        for n in range(1, 8):
            add_letter(conn, table, n, "ValueError: bad order" if n % 2 else "KeyError: 'sku'")
        conn.execute(Store(engine, settings).offsets.insert().values(
            consumer_group=GROUP, topic="t", partition_id=0, next_offset=5, epoch=1, updated_at=now()))
    engine.dispose()
    return dsn


@contextmanager
def console_client(dsn: str, **settings: object) -> Iterator[TestClient]:
    web = app(Settings(dsn=dsn, bootstrap_servers="127.0.0.1:1", console_sample_interval_s=0, **settings))
    with TestClient(web, base_url="http://127.0.0.1") as client:
        yield client


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def log_in(client: TestClient, name: str = "ann") -> str:
    token = csrf_of(client.get("/login").text)
    r = client.post("/login", data={"csrf_token": token, "operator": name, "password": PASSWORD})
    assert r.status_code == 200 and f'<span id="operator">{name}</span>' in r.text
    return csrf_of(r.text)


def statuses(dsn: str, status: str | None = None) -> object:
    engine = make_engine(Settings(dsn=dsn))
    t = deadletters.build_table()
    with engine.connect() as conn:
        if status is None:
            found: object = set(conn.execute(sa.select(t.c.status)).scalars())
        else:
            found = list(conn.execute(sa.select(t.c.id).where(t.c.status == status).order_by(t.c.id)).scalars())
    engine.dispose()
    return found
