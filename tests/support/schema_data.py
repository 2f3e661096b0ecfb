"""Schemas the tests read and write: Avro records (an order, and a second version of it with a field
added with a default), a JSON Schema, and a Protobuf message class built at run time (no protoc
needed), with matching typed models."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pydantic

ORDER_V1 = json.dumps({
    "type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [{"name": "id", "type": "long"}, {"name": "customer", "type": "string"},
               {"name": "amount", "type": "double"}],
})
#: Version 2: a field added with a default (BACKWARD compatible: a v2 reader reads v1 records).
ORDER_V2 = json.dumps({
    "type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [{"name": "id", "type": "long"}, {"name": "customer", "type": "string"},
               {"name": "amount", "type": "double"},
               {"name": "currency", "type": "string", "default": "EUR"}],
})
#: A reader no v1 record resolves to: a field without a default that v1 lacks.
ORDER_NEEDS_COUPON = json.dumps({
    "type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [{"name": "id", "type": "long"}, {"name": "coupon", "type": "string"}],
})
ORDER_EVENT = json.dumps({
    "type": "record", "name": "OrderAccepted", "namespace": "shop",
    "fields": [{"name": "order_id", "type": "long"}, {"name": "total_cents", "type": "long"}],
})
ORDER_JSON_SCHEMA = json.dumps({
    "$schema": "http://json-schema.org/draft-07/schema#", "title": "OrderPlaced", "type": "object",
    "properties": {"id": {"type": "integer"}, "customer": {"type": "string"}, "amount": {"type": "number"}},
    "required": ["id", "customer", "amount"],
})


class OrderModel(pydantic.BaseModel):
    id: int
    customer: str
    amount: float
    currency: str = "EUR"


@dataclasses.dataclass
class OrderRecord:
    id: int
    customer: str
    amount: float
    currency: str = "EUR"


def protobuf_order_class() -> Any:
    """An ``OrderPlaced`` Protobuf message class (id int64, customer string, amount double), as protoc
    would generate it, built from a descriptor in its own pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="kstore_test_orders.proto", package="shop", syntax="proto3")
    message = file.message_type.add(name="OrderPlaced")
    kinds = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind) in enumerate((("id", kinds.TYPE_INT64), ("customer", kinds.TYPE_STRING),
                                            ("amount", kinds.TYPE_DOUBLE)), start=1):
        message.field.add(name=name, number=number, type=kind, label=kinds.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.OrderPlaced"))


def registry_client(url: str, **config: Any) -> Any:
    """The tests' own schema registry client: with a timeout, so a request the registry leaves
    unanswered (seen once on a keep-alive connection) is retried, not waited on for ever."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    return SchemaRegistryClient({"url": url, "timeout": 20, **config})
