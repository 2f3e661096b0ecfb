"""The database's own limit (28): the backlog's rows COPYed into PostgreSQL from memory, no Kafka;
and (32) the same through kstore's ``copy_rows``, its encoding timed.

Before the clock starts, the child reads the whole backlog with confluent-kafka and (28) encodes it
in COPY's text format, ``ROWS_PER_TRANSACTION`` rows a chunk. Timed: one ``COPY ... FROM STDIN``
and one COMMIT per chunk over one psycopg2 connection, nothing else. That is what PostgreSQL
alone takes to store these rows on this machine, the limit a pipeline that COPYs (kstore's
``copy_rows``) can approach but not pass; the ratio 25/28 says how close it comes.

32 times the rows' tuples through ``copy_rows`` (checking and encoding them, then the COPY) in one
transaction per chunk, as a worker's batch would, with no Kafka: 32/28 is what kstore's encoding
costs the database's own COPY, 25/32 what reading Kafka and the worker's bookkeeping cost beside it.
"""

from __future__ import annotations

import io
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from .meter import Meter

#: Rows a transaction: about what kstore's COPY contender commits at a time on a drained backlog.
ROWS_PER_TRANSACTION = 5000
COLUMNS = ("partition_id", "kafka_offset", "payload")


def read_backlog(config: dict[str, Any]) -> list[tuple[int, int, bytes]]:
    """Every message of the topic as ``(partition, offset, value)``, read from the beginning."""
    consumer = Consumer({"bootstrap.servers": config["bootstrap"], "group.id": config["group"],
                         "enable.auto.commit": False, "fetch.queue.backoff.ms": 10})
    consumer.assign([TopicPartition(config["topic"], p, OFFSET_BEGINNING) for p in range(config["partitions"])])
    rows: list[tuple[int, int, bytes]] = []
    try:
        while len(rows) < config["messages"]:
            for msg in consumer.consume(num_messages=5000, timeout=1.0):
                if msg.error():
                    raise RuntimeError(f"confluent-kafka: {msg.error()}")
                rows.append((msg.partition(), msg.offset(), msg.value()))
    finally:
        consumer.close()
    return rows


def text_chunks(rows: list[tuple[int, int, bytes]], size: int) -> list[tuple[int, bytes]]:
    """``(row count, COPY text data)`` per ``size`` rows: bytea as ``\\\\x`` hex."""
    return [(len(chunk), b"".join(b"%d\t%d\t\\\\x%s\n" % (p, o, v.hex().encode()) for p, o, v in chunk))
            for chunk in chunked(rows, size)]


def chunked(rows: list[tuple[int, int, bytes]], size: int) -> list[list[tuple[int, int, bytes]]]:
    """``rows`` in transactions of ``size``."""
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def run_copy_rows(config: dict[str, Any], meter: Meter) -> None:
    import sqlalchemy as sa

    from kstore.db.copy import copy_rows

    chunks = chunked(read_backlog(config), ROWS_PER_TRANSACTION)
    engine = sa.create_engine(config["dsn"], poolclass=sa.pool.StaticPool)
    try:
        with engine.connect() as conn:
            meter.started()
            for chunk in chunks:
                with conn.begin():
                    copy_rows(conn, config["table"], chunk, COLUMNS)
                if meter.counted(len(chunk)):
                    meter.finished()
    finally:
        engine.dispose()


def run(config: dict[str, Any], meter: Meter) -> None:
    import psycopg2

    chunks = text_chunks(read_backlog(config), ROWS_PER_TRANSACTION)
    sql = f"COPY {config['table']} (partition_id, kafka_offset, payload) FROM STDIN"
    conn = psycopg2.connect(**config["conninfo"])
    try:
        with conn.cursor() as cur:
            meter.started()
            for n, data in chunks:
                cur.copy_expert(sql, io.BytesIO(data), size=1 << 20)
                if cur.rowcount != n:
                    raise RuntimeError(f"COPY reported {cur.rowcount} rows, {n} sent")
                conn.commit()
                if meter.counted(n):
                    meter.finished()
    finally:
        conn.close()
