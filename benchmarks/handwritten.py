"""Contenders 11 and 12: the loops a competent user writes by hand with ``execute_values``.

kafka-python and psycopg2 only (the same loops on confluent-kafka:
``handwritten_confluent``). Per poll, every message's row goes in with
``psycopg2.extras.execute_values`` (psycopg2's multi-row ``INSERT ... VALUES``):

- **at-least-once** (11): the database COMMIT, then ``consumer.commit()``. A crash
  between the two repeats the poll's rows.
- **exactly-once** (12): the poll's offsets go into an offsets table with one
  ``INSERT ... ON CONFLICT DO UPDATE`` in the same transaction as the rows, one
  COMMIT, nothing committed to Kafka; on assignment it seeks every partition to its
  stored offset. No fencing of a paused worker, no reset handling, no answer to a
  lost COMMIT: the loop kstore replaces, at its simplest.

Tuned as a competent user would for throughput (``config["tuning"]``, set per
contender in ``contenders``): kafka-python's ``max_poll_records`` and
``execute_values``' ``page_size``; without them, the libraries' defaults (500
records per poll, 100 rows per statement).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg2
from kafka import ConsumerRebalanceListener, KafkaConsumer

from .handsql import (
    Rows,
    create_offsets_table,
    insert_sql,
    offsets_table,
    page_size,
    stored_offsets,
    upsert_sql,
    write_values,
)
from .meter import Meter, signal_ready
from .raw_loops import kafka_python_consumer, kafka_python_tuning

__all__ = ["at_least_once", "at_least_once_with", "drain", "exactly_once", "offsets_table"]


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
        if meter.batch_done(rows, after):
            return


def at_least_once(config: dict[str, Any], meter: Meter) -> None:
    page = page_size(config)
    at_least_once_with(config, meter, insert_sql(config), lambda cur, sql, rows: write_values(cur, sql, rows, page))


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


class _SeekToStored(ConsumerRebalanceListener):  # type: ignore[misc]
    """On assignment, seek each partition to the offset stored in the database (or 0)."""

    def __init__(self, consumer: KafkaConsumer, config: dict[str, Any]) -> None:
        self.consumer = consumer
        self.config = config
        self.conn = psycopg2.connect(**config["conninfo"])

    def on_partitions_assigned(self, assigned: Any) -> None:
        stored = stored_offsets(self.conn, self.config)
        for tp in assigned:
            self.consumer.seek(tp, stored.get((tp.topic, tp.partition), 0))
        if assigned:
            signal_ready(self.config.get("ready_file"))

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass


def exactly_once(config: dict[str, Any], meter: Meter) -> None:
    conn = psycopg2.connect(**config["conninfo"])
    create_offsets_table(conn, config)
    sql, upsert, page = insert_sql(config), upsert_sql(config), page_size(config)
    group = config["group"]
    consumer = KafkaConsumer(
        bootstrap_servers=config["bootstrap"], group_id=group, client_id=f"bench-{config['contender']}",
        enable_auto_commit=False, auto_offset_reset="earliest", **kafka_python_tuning(config),
    )
    listener = _SeekToStored(consumer, config)
    consumer.subscribe([config["topic"]], listener=listener)

    def write(batches: Any, rows: Rows) -> None:
        write_values(cur, sql, rows, page)
        write_values(cur, upsert, [(group, tp.topic, tp.partition, records[-1].offset + 1)
                                   for tp, records in batches.items()], 0)
        conn.commit()

    try:
        with conn.cursor() as cur:
            drain(consumer, meter, write)
    finally:
        consumer.close(autocommit=False)
        listener.conn.close()
        conn.close()
