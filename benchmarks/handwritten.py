"""Contenders 11 and 12: the loops a competent user writes by hand with ``execute_values``.

kafka-python and psycopg2 only. Per poll, every message's row goes in with
``psycopg2.extras.execute_values`` (psycopg2's multi-row ``INSERT ... VALUES``,
its own default page of 100 rows per statement):

- **at-least-once** (11): the database COMMIT, then ``consumer.commit()``. A crash
  between the two repeats the poll's rows.
- **exactly-once** (12): the poll's offsets go into an offsets table with one
  ``INSERT ... ON CONFLICT DO UPDATE`` in the same transaction as the rows, one
  COMMIT, nothing committed to Kafka; on assignment it seeks every partition to its
  stored offset. No fencing of a paused worker, no reset handling, no answer to a
  lost COMMIT: the loop kstore replaces, at its simplest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg2
from kafka import ConsumerRebalanceListener, KafkaConsumer
from psycopg2.extras import execute_values

from .meter import Meter, signal_ready
from .raw_loops import kafka_python_consumer


def _insert_sql(config: dict[str, Any]) -> str:
    # The table name is made by the benchmark (letters, digits, _), never user input.
    return f"INSERT INTO {config['table']} (partition_id, kafka_offset, payload) VALUES %s"


Rows = list[tuple[int, int, bytes]]


def drain(consumer: Any, meter: Meter, write: Callable[[Any, Rows], None],
          after: Callable[[], None] | None = None) -> None:
    """The hand-written loops' shape: poll, ``write`` the poll's rows and commit them, stamp
    them done (the effects are visible from then on), ``after()``, until every message is in."""
    while True:
        batches = consumer.poll(timeout_ms=1000)
        if not batches:
            continue
        meter.started()
        rows = [(r.partition, r.offset, r.value) for records in batches.values() for r in records]
        write(batches, rows)
        if meter.latency:
            meter.stamp(row[2] for row in rows)
        if after is not None:
            after()
        if meter.counted(len(rows)):
            meter.finished()
            return


def at_least_once(config: dict[str, Any], meter: Meter) -> None:
    at_least_once_with(config, meter, _insert_sql(config), execute_values)


def at_least_once_with(config: dict[str, Any], meter: Meter, sql: str,
                       insert: Callable[[Any, str, Rows], Any]) -> None:
    """Per poll ``insert(cursor, sql, rows)``, the database COMMIT, then the Kafka commit."""
    conn = psycopg2.connect(**config["conninfo"])
    consumer = kafka_python_consumer(config)

    def write(_batches: Any, rows: Rows) -> None:
        insert(cur, sql, rows)
        conn.commit()

    try:
        with conn.cursor() as cur:
            drain(consumer, meter, write, after=consumer.commit)
    finally:
        consumer.close(autocommit=False)
        conn.close()


def offsets_table(config: dict[str, Any]) -> str:
    """The hand-written exactly-once loop's own offsets table, beside its effects table."""
    return f"{config['table']}_offsets"


class _SeekToStored(ConsumerRebalanceListener):  # type: ignore[misc]
    """On assignment, seek each partition to the offset stored in the database (or 0)."""

    def __init__(self, consumer: KafkaConsumer, config: dict[str, Any]) -> None:
        self.consumer = consumer
        self.config = config
        self.conn = psycopg2.connect(**config["conninfo"])

    def on_partitions_assigned(self, assigned: Any) -> None:
        with self.conn, self.conn.cursor() as cur:
            cur.execute(f"SELECT topic, partition_id, next_offset FROM {offsets_table(self.config)} "
                        "WHERE consumer_group = %s", (self.config["group"],))
            stored = {(t, p): n for t, p, n in cur.fetchall()}
        for tp in assigned:
            self.consumer.seek(tp, stored.get((tp.topic, tp.partition), 0))
        if assigned:
            signal_ready(self.config.get("ready_file"))

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass


def exactly_once(config: dict[str, Any], meter: Meter) -> None:
    conn = psycopg2.connect(**config["conninfo"])
    offsets = offsets_table(config)
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {offsets} (consumer_group text, topic text, partition_id integer, "
                    "next_offset bigint NOT NULL, PRIMARY KEY (consumer_group, topic, partition_id))")
    sql = _insert_sql(config)
    upsert = (f"INSERT INTO {offsets} (consumer_group, topic, partition_id, next_offset) VALUES %s "
              "ON CONFLICT (consumer_group, topic, partition_id) DO UPDATE SET next_offset = EXCLUDED.next_offset")
    group = config["group"]
    consumer = KafkaConsumer(
        bootstrap_servers=config["bootstrap"], group_id=group, client_id=f"bench-{config['contender']}",
        enable_auto_commit=False, auto_offset_reset="earliest",
    )
    listener = _SeekToStored(consumer, config)
    consumer.subscribe([config["topic"]], listener=listener)
    def write(batches: Any, rows: Rows) -> None:
        execute_values(cur, sql, rows)
        execute_values(cur, upsert, [(group, tp.topic, tp.partition, records[-1].offset + 1)
                                     for tp, records in batches.items()])
        conn.commit()

    try:
        with conn.cursor() as cur:
            drain(consumer, meter, write)
    finally:
        consumer.close(autocommit=False)
        listener.conn.close()
        conn.close()
