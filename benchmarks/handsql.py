"""The SQL of the hand-written loops, the same on either Kafka client: psycopg2 only.

Every loop writes a poll's rows with ``psycopg2.extras.execute_values``; the
exactly-once ones also upsert the poll's next offsets into their own offsets
table in the same transaction. ``config["tuning"]["page_size"]`` is the rows per
statement (psycopg2's default is 100; 0 sends the whole poll as one statement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg2.extras import execute_values

Rows = list[tuple[int, int, bytes]]

#: psycopg2's own default page of ``execute_values``.
DEFAULT_PAGE_SIZE = 100


def insert_sql(config: dict[str, Any]) -> str:
    # The table name is made by the benchmark (letters, digits, _), never user input.
    return f"INSERT INTO {config['table']} (partition_id, kafka_offset, payload) VALUES %s"


def offsets_table(config: dict[str, Any]) -> str:
    """The hand-written exactly-once loop's own offsets table, beside its effects table."""
    return f"{config['table']}_offsets"


def create_offsets_table(conn: Any, config: dict[str, Any]) -> None:
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {offsets_table(config)} (consumer_group text, topic text, "
                    "partition_id integer, next_offset bigint NOT NULL, "
                    "PRIMARY KEY (consumer_group, topic, partition_id))")


def stored_offsets(conn: Any, config: dict[str, Any]) -> dict[tuple[str, int], int]:
    """``{(topic, partition): next offset}`` as the loop stored them for its group."""
    with conn, conn.cursor() as cur:
        cur.execute(f"SELECT topic, partition_id, next_offset FROM {offsets_table(config)} "
                    "WHERE consumer_group = %s", (config["group"],))
        return {(t, p): n for t, p, n in cur.fetchall()}


def upsert_sql(config: dict[str, Any]) -> str:
    return (f"INSERT INTO {offsets_table(config)} (consumer_group, topic, partition_id, next_offset) VALUES %s "
            "ON CONFLICT (consumer_group, topic, partition_id) DO UPDATE SET next_offset = EXCLUDED.next_offset")


def page_size(config: dict[str, Any]) -> int:
    """Rows per ``execute_values`` statement; 0: the whole poll."""
    return int(config.get("tuning", {}).get("page_size", DEFAULT_PAGE_SIZE))


def write_values(cur: Any, sql: str, rows: Sequence[tuple[Any, ...]], page: int) -> None:
    """``execute_values`` with ``page`` rows per statement (0: all of them in one)."""
    execute_values(cur, sql, rows, page_size=page or max(1, len(rows)))
