"""Contender 29: the hand-written exactly-once loop on confluent-kafka (19) reading Avro values.

Contender 19 as it is (the same consumer, tuning, batches and transaction: the rows and one
upsert of the batch's next offsets into the loop's own offsets table, one COMMIT), except that
each value is decoded as confluent-kafka's documentation shows::

    deserializer = AvroDeserializer(SchemaRegistryClient({"url": ...}))
    record = deserializer(msg.value(), SerializationContext(msg.topic(), MessageField.VALUE))

and the record's fields are the row (``benchmarks.avro``: the Avro effects table). Kept apart
from ``confluent_loops`` so contender 19's child never loads the schema registry's libraries.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from .confluent_loops import Ends, _checked, consumer_for, fetcher
from .meter import Meter, signal_ready

Row = tuple[int, int, int, str, float, int]


def insert_sql(config: dict[str, Any]) -> str:
    # The table name is made by the benchmark (letters, digits, _), never user input.
    return f"INSERT INTO {config['table']} (partition_id, kafka_offset, id, name, price, quantity) VALUES %s"


def exactly_once(config: dict[str, Any], meter: Meter) -> None:
    import psycopg2
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from .handsql import create_offsets_table, page_size, stored_offsets, upsert_sql, write_values

    deserializer = AvroDeserializer(SchemaRegistryClient({"url": config["schema_registry_url"]}))
    conn = psycopg2.connect(**config["conninfo"])
    create_offsets_table(conn, config)
    sql, upsert, page = insert_sql(config), upsert_sql(config), page_size(config)
    group = config["group"]
    ready_file = config.get("ready_file")

    def on_assign(consumer: Any, partitions: list[TopicPartition]) -> None:
        stored = stored_offsets(conn, config)
        for tp in partitions:
            tp.offset = stored.get((tp.topic, tp.partition), OFFSET_BEGINNING)
        consumer.assign(partitions)
        if partitions:
            signal_ready(ready_file)

    consumer = consumer_for(config, on_assign)
    fetch = fetcher(consumer, config, meter.latency, per_message=False)
    try:
        with conn.cursor() as cur:
            while True:
                msgs = fetch()
                if not msgs:
                    continue
                meter.started()
                rows: list[Row] = []
                ends: Ends = {}
                for msg in _checked(msgs):
                    partition, offset, topic = msg.partition(), msg.offset(), msg.topic()
                    record = deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE))
                    rows.append((partition, offset, record["id"], record["name"], record["price"],
                                 record["quantity"]))
                    ends[(topic, partition)] = offset + 1
                write_values(cur, sql, rows, page)
                write_values(cur, upsert, [(group, t, p, n) for (t, p), n in ends.items()], 0)
                conn.commit()
                if meter.latency:
                    meter.stamp_ns(row[2] for row in rows)  # ``id``: the produce time
                if meter.counted(len(rows)):
                    meter.finished()
                    return
    finally:
        consumer.close()
        conn.close()
