"""Contender 3: the at-least-once loop a user writes by hand today.

kafka-python and psycopg2, nothing else: per poll batch, one INSERT per message
sent with ``cursor.executemany``, the database commit, then the Kafka offset
commit. A crash between the two commits repeats the batch: at-least-once.
psycopg2's ``executemany`` runs the statement once per row (one round trip
each); that is what the obvious code does, so that is the baseline.
"""

from __future__ import annotations

from typing import Any

from .handwritten import at_least_once_with
from .meter import Meter


def run(config: dict[str, Any], meter: Meter) -> None:
    # The table name is made by the benchmark (letters, digits, _), never user input.
    sql = f"INSERT INTO {config['table']} (partition_id, kafka_offset, payload) VALUES (%s, %s, %s)"
    at_least_once_with(config, meter, sql, lambda cur, sql, rows: cur.executemany(sql, rows))
