"""The schemas a processor writes with: :class:`Avro`, :class:`JsonSchema` and :class:`Protobuf`, each
serialized by confluent-kafka's serializer of that format, in the Confluent wire format (a zero byte,
the schema's 4-byte id, the payload), under the subject its naming strategy gives."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kstore.errors import ConfigurationError

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

#: The subject naming strategies: the topic's (``<topic>-value``), the record's full name, or both
#: (``<topic>-<record name>``).
SUBJECT_NAME_STRATEGIES = ("topic", "record", "topic_record")


class Schema:
    """What :meth:`~kstore.Processor.produce` serializes a key or value with (see the subclasses)."""

    #: The format's name, as ``key_format``/``value_format`` spell it.
    format: str = ""

    def __init__(self, *, subject_name_strategy: str = "topic", auto_register: bool = True) -> None:
        if subject_name_strategy not in SUBJECT_NAME_STRATEGIES:
            raise ConfigurationError(f"subject_name_strategy must be one of {', '.join(SUBJECT_NAME_STRATEGIES)}, "
                                     f"got {subject_name_strategy!r}")
        #: Which subject the schema is registered (or looked up) under.
        self.subject_name_strategy = subject_name_strategy
        #: Register the schema at its first use if the subject lacks it (else it must be registered).
        self.auto_register = auto_register

    def _conf(self) -> dict[str, Any]:
        from confluent_kafka.schema_registry import (
            record_subject_name_strategy,
            topic_record_subject_name_strategy,
            topic_subject_name_strategy,
        )

        strategy = {"topic": topic_subject_name_strategy, "record": record_subject_name_strategy,
                    "topic_record": topic_record_subject_name_strategy}[self.subject_name_strategy]
        return {"auto.register.schemas": self.auto_register, "subject.name.strategy": strategy}

    def serializer(self, client: SchemaRegistryClient) -> Callable[[Any, Any], bytes | None]:
        """confluent-kafka's serializer of this schema, called with a value and a SerializationContext."""
        raise NotImplementedError

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and type(other) is type(self) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((type(self), self._key()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._key()[0]!r:.60})"


def _text(schema: str | Mapping[str, Any], kind: str) -> str:
    if isinstance(schema, Mapping):
        return json.dumps(schema)
    if not isinstance(schema, str):
        raise ConfigurationError(f"{kind}(...) takes the schema as JSON text or a dict, got {type(schema).__name__}")
    try:
        json.loads(schema)
    except ValueError as exc:
        raise ConfigurationError(f"{kind}(...): the schema is not JSON: {exc}") from None
    return schema


class Avro(Schema):
    """An Avro schema (JSON text or a dict). Values are dicts, dataclasses or pydantic models."""

    format = "avro"

    def __init__(self, schema: str | Mapping[str, Any], **options: Any) -> None:
        super().__init__(**options)
        self.schema = _text(schema, "Avro")

    def serializer(self, client: SchemaRegistryClient) -> Callable[[Any, Any], bytes | None]:
        from confluent_kafka.schema_registry.avro import AvroSerializer

        serializer: Callable[[Any, Any], bytes | None] = AvroSerializer(client, self.schema, conf=self._conf())
        return serializer

    def _key(self) -> tuple[Any, ...]:
        return (self.schema, self.subject_name_strategy, self.auto_register)


class JsonSchema(Schema):
    """A JSON Schema (JSON text or a dict): values are validated against it, then written as JSON."""

    format = "json-schema"

    def __init__(self, schema: str | Mapping[str, Any], **options: Any) -> None:
        super().__init__(**options)
        self.schema = _text(schema, "JsonSchema")

    def serializer(self, client: SchemaRegistryClient) -> Callable[[Any, Any], bytes | None]:
        from confluent_kafka.schema_registry.json_schema import JSONSerializer

        serializer: Callable[[Any, Any], bytes | None] = JSONSerializer(self.schema, client, conf=self._conf())
        return serializer

    def _key(self) -> tuple[Any, ...]:
        return (self.schema, self.subject_name_strategy, self.auto_register)


class Protobuf(Schema):
    """A Protobuf message type (the class protoc generated): values are instances of it."""

    format = "protobuf"

    def __init__(self, message_type: type, **options: Any) -> None:
        super().__init__(**options)
        if not hasattr(message_type, "DESCRIPTOR"):
            raise ConfigurationError(f"Protobuf(...) takes a generated message class, got {message_type!r}")
        self.message_type = message_type

    def serializer(self, client: SchemaRegistryClient) -> Callable[[Any, Any], bytes | None]:
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

        conf = {**self._conf(), "use.deprecated.format": False}
        serializer: Callable[[Any, Any], bytes | None] = ProtobufSerializer(self.message_type, client, conf=conf)
        return serializer

    def _key(self) -> tuple[Any, ...]:
        return (self.message_type, self.subject_name_strategy, self.auto_register)
