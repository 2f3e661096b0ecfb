"""Contender 3: the at-least-once loop a user writes by hand today.

kafka-python and psycopg2, nothing else: per poll batch, one INSERT per message
sent with ``cursor.executemany``, the database commit, then the Kafka offset
commit. A crash between the two commits repeats the batch: at-least-once.
psycopg2's ``executemany`` runs the statement once per row (one round trip
each); that is what the obvious code does, so that is the baseline.
"""

from __future__ import annotations

from typing import Any

import psycopg2

from .meter import Meter
from .raw_loops import kafka_python_consumer


def run(config: dict[str, Any], meter: Meter) -> None:
    conn = psycopg2.connect(**config["conninfo"])
    # The table name is made by the benchmark (letters, digits, _), never user input.
    sql = f"INSERT INTO {config['table']} (partition_id, kafka_offset, payload) VALUES (%s, %s, %s)"
    consumer = kafka_python_consumer(config)
    try:
        with conn.cursor() as cur:
            while True:
                batches = consumer.poll(timeout_ms=1000)
                if not batches:
                    continue
                meter.started()
                rows = [(r.partition, r.offset, r.value) for records in batches.values() for r in records]
                cur.executemany(sql, rows)
                conn.commit()
                if meter.latency:  # the effects are visible from here on
                    meter.stamp(row[2] for row in rows)
                consumer.commit()
                if meter.counted(len(rows)):
                    meter.finished()
                    return
    finally:
        consumer.close(autocommit=False)
        conn.close()
