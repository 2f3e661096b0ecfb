"""The Avro workload of contenders 29 and 30: its schema, its values, its effects table.

Each value is a record in the Confluent wire format (a zero byte, the 4-byte schema id, the
Avro payload) of :data:`SCHEMA`, registered under the topic's subject (``<topic>-value``, the
default TopicNameStrategy) in the run's schema registry before anything is produced:

- ``id`` (long): the produce time in nanoseconds (``time.time_ns()``), which the latency phase
  reads back as the bytes workload's 19 leading digits;
- ``name`` (string): filler, so a value is ``--size`` bytes as the bytes workload's are;
- ``price`` (double) and ``quantity`` (int).

Both contenders decode each value and write its four fields as a row of a typed effects table
(:data:`COLUMNS`): ``partition_id`` and ``kafka_offset`` first, as in every effects table, so the
exactly-once check reads it unchanged.

Encoded here with fastavro's ``schemaless_writer`` and the parsed schema (both contenders read
the very same bytes); the parent imports this module, the children only its constants.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

#: The record every value of the Avro workload holds.
SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "BenchRecord",
    "namespace": "kstore.benchmarks",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": "string"},
        {"name": "price", "type": "double"},
        {"name": "quantity", "type": "int"},
    ],
}
SCHEMA_STR = json.dumps(SCHEMA, separators=(",", ":"))
#: The Avro effects table's columns after ``partition_id`` and ``kafka_offset``: the record's fields.
COLUMNS_SQL = "id bigint NOT NULL, name text NOT NULL, price double precision NOT NULL, quantity integer NOT NULL"
FIELDS = ("id", "name", "price", "quantity")
#: The zero byte and the 4-byte schema id in front of every payload.
HEADER_BYTES = 5


def subject(topic: str) -> str:
    """The subject a value of ``topic`` is registered under (TopicNameStrategy, confluent-kafka's default)."""
    return f"{topic}-value"


def register(url: str, topic: str) -> int:
    """Register :data:`SCHEMA` for ``topic``'s values in the registry at ``url``; its schema id."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    client = SchemaRegistryClient({"url": url})
    return int(client.register_schema(subject(topic), Schema(SCHEMA_STR, "AVRO")))


class AvroValues:
    """``values()``: a ``size``-byte wire-format value of :data:`SCHEMA` stamped with the current time
    (``id``), its ``price`` and ``quantity`` varying from one to the next."""

    def __init__(self, schema_id: int, size: int) -> None:
        from fastavro import parse_schema, schemaless_writer

        self._write = schemaless_writer
        self._schema = parse_schema(SCHEMA)
        self._header = b"\x00" + schema_id.to_bytes(4, "big")
        self._n = 0
        # The name takes up what the other fields leave of ``size`` (its length's varint included).
        record = {"id": time.time_ns(), "name": "", "price": 0.0, "quantity": 0}
        length = max(0, size - len(self._encode(record)))
        while length and len(self._encode({**record, "name": "x" * length})) > size:
            length -= 1
        self._name = "x" * length

    def _encode(self, record: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        out.write(self._header)
        self._write(out, self._schema, record)
        return out.getvalue()

    def __call__(self) -> bytes:
        n = self._n = self._n + 1
        return self._encode({"id": time.time_ns(), "name": self._name, "price": n * 0.25, "quantity": n % 64})
