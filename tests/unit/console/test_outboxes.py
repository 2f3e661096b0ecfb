"""The console's first page lists every outbox, an application's too (which no group's page shows),
with its records waiting and the oldest's age, each linked to its outbox page (on SQLite, through
Starlette's test client)."""

from __future__ import annotations

import html
import re

import sqlalchemy as sa
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from kstore import Settings
from kstore.db.store import make_engine
from kstore.outbox import Outbox
from kstore.relay import store, tables
from tests.support.console_pages import GROUP

#: An application's outbox named with characters a URL path carries only escaped.
APP = "shop/web & eu?"
#: A row of the outboxes' table: its link, its name and its records waiting.
ROW = re.compile(r'<a class="outbox" href="([^"]+)">([^<]+)</a></td>\s*<td class="num waiting">(\d+)</td>'
                 r'<td class="num">([^<]+)</td>')


def test_the_groups_page_lists_an_applications_outbox_with_its_records_waiting_and_links_to_its_page(
        dsn: str, read_only: TestClient) -> None:
    engine = make_engine(Settings(dsn=dsn))
    store.Outbox(engine, GROUP).ensure_shards(2)  # the group's own outbox: nothing produced
    events = Outbox(APP, Settings(dsn=dsn), shards=2)
    with Session(engine) as session, session.begin():
        for n in range(3):
            events.produce(session, "orders", {"n": n}, key=f"k{n}")
    engine.dispose()

    page = read_only.get("/")
    assert page.status_code == 200, page.text
    rows = [(link, html.unescape(name), int(waiting), age) for link, name, waiting, age in ROW.findall(page.text)]
    assert [(name, waiting) for _, name, waiting, _ in rows] == [(GROUP, 0), (APP, 3)], page.text
    assert rows[0][3] == "-" and float(rows[1][3]) >= 0.0, "no oldest where none waits"
    link = html.unescape(rows[1][0])
    assert link == "http://127.0.0.1/groups/shop~2Fweb~20~26~20eu~3F/outbox"

    shown = read_only.get(link)
    assert shown.status_code == 200 and f"<h1>{html.escape(APP)}</h1>" in shown.text, shown.text
    waiting = re.findall(r'<tr><td class="num">\d+</td><td class="num">(\d+)</td>', shown.text)
    assert len(waiting) == 2 and sum(map(int, waiting)) == 3, shown.text  # its two shards


def test_the_groups_page_says_when_the_database_has_no_outbox(read_only: TestClient, dsn: str) -> None:
    engine = make_engine(Settings(dsn=dsn))
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(tables.build_tables().shards)).scalar_one() == 0
    engine.dispose()
    page = read_only.get("/")
    assert page.status_code == 200 and 'id="outboxes">No outbox in this database yet.' in page.text, page.text
