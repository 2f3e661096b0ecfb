"""Processors that read and write schemas through the registry (``KSTORE_SCHEMA_REGISTRY_URL``), for
the schema tests: each writes one effect row per message (``effects``: topic, partition, offset and
what it read) and produces one record per message to ``KSTORE_TEST_OUT_TOPIC``."""

from __future__ import annotations

import os
from collections.abc import Sequence

import sqlalchemy as sa
from schema_data import ORDER_EVENT, ORDER_V2, OrderRecord, protobuf_order_class

from kstore import Message, Processor
from kstore.schemas import Avro, JsonSchema

metadata = sa.MetaData()
effects = sa.Table(
    "orders_seen", metadata,
    sa.Column("topic", sa.String(200), primary_key=True),
    sa.Column("partition_id", sa.Integer, primary_key=True),
    sa.Column("kafka_offset", sa.BigInteger, primary_key=True),
    sa.Column("order_id", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(10), nullable=False),
)
OUT = os.environ.get("KSTORE_TEST_OUT_TOPIC", "out")

ORDER_EVENT_JSON = {
    "$schema": "http://json-schema.org/draft-07/schema#", "title": "OrderAccepted", "type": "object",
    "properties": {"order_id": {"type": "integer"}, "total_cents": {"type": "integer"}},
    "required": ["order_id", "total_cents"],
}


class _Orders(Processor):
    on_error = "dead_letter"

    def setup(self) -> None:
        metadata.create_all(self.engine)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        rows = []
        for msg in msgs:
            order = msg.value
            currency = getattr(order, "currency", "EUR") or "EUR"
            rows.append({"topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset,
                         "order_id": order.id, "currency": currency})
            self.produce(OUT, {"order_id": order.id, "total_cents": round(order.amount * 100)}, key=str(order.id))
        self.session.execute(effects.insert(), rows)


class AvroOrders(_Orders):
    """Avro orders in (read as version 2, so version 1 records get the default currency, into a
    dataclass), Avro events out."""

    group = "avro-orders"
    value_format = "avro"
    value_schema = ORDER_V2
    value_model = OrderRecord
    output_schemas = {OUT: Avro(ORDER_EVENT)}


class JsonSchemaOrders(_Orders):
    """JSON Schema orders in (into a dataclass), JSON Schema events out."""

    group = "json-schema-orders"
    value_format = "json-schema"
    value_model = OrderRecord
    output_schemas = {OUT: JsonSchema(ORDER_EVENT_JSON)}


class ProtobufOrders(_Orders):
    """Protobuf orders in, Avro events out."""

    group = "protobuf-orders"
    value_format = "protobuf"
    value_model = protobuf_order_class()
    output_schemas = {OUT: Avro(ORDER_EVENT)}
