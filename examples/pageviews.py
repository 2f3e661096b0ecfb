"""Page views counted per page, exactly once.

Each event on the ``page-views`` topic is JSON like ``{"page": "/pricing", "user": "u42"}``.
The counts and the offsets commit in one transaction, so a crash, a restart or a
rebalance never counts a view twice or loses one.

Run it (after ``kstore migrate``)::

    kstore worker pageviews:PageViewCounter --bootstrap-servers 127.0.0.1:9092            # SQLite
    kstore worker pageviews:PageViewCounter --dsn postgresql+psycopg2://me@localhost/app   # PostgreSQL
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sqlalchemy import Column, Integer, MetaData, String, Table, text

from kstore import Message, Processor

metadata = MetaData()
page_views = Table(
    "page_views",
    metadata,
    Column("page", String(500), primary_key=True),
    Column("views", Integer, nullable=False),
)

# Works on PostgreSQL and SQLite alike (both speak INSERT ... ON CONFLICT).
UPSERT = text(
    "INSERT INTO page_views (page, views) VALUES (:page, :views) "
    "ON CONFLICT (page) DO UPDATE SET views = page_views.views + excluded.views"
)


class PageViewCounter(Processor):
    topics = ["page-views"]
    group = "page-view-counter"
    value_format = "json"

    def setup(self) -> None:
        # The application's own table; a real project would create it with its own migrations.
        metadata.create_all(self.engine)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        # One statement per page per batch instead of one per message.
        counts = Counter(m.value["page"] for m in msgs)
        self.session.execute(UPSERT, [{"page": page, "views": n} for page, n in counts.items()])
