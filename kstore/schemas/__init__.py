"""Schemas: keys and values in Avro, Protobuf and JSON Schema, in the Confluent wire format, with their
schemas in a schema registry (Confluent Schema Registry, Apicurio, Karapace); typed messages.

A processor reads them with ``value_format = "avro"`` (or ``"protobuf"``, ``"json-schema"``; the same
for keys) and writes them with :meth:`~kstore.Processor.produce` given a schema, per output topic
(``output_schemas``) or per call::

    from kstore.schemas import Avro

    class Orders(Processor):
        topics = ["orders"]
        value_format = "avro"
        value_model = OrderPlaced            # optional: msg.value is an OrderPlaced
        output_schemas = {"order-events": Avro(ORDER_EVENT)}

Owns: the registry client and how its failures are sorted (:mod:`.registry`; an unknown schema id
weighed against what the registry knows, :mod:`.unknown`), reading and writing
the formats (:mod:`.formats`), the schemas a processor writes with (:mod:`.specs`), typed values
(:mod:`.models`). Imports settings, errors and types of kstore's; confluent-kafka's schema registry
package only when a format needs it (``pip install 'kstore[schemas]'``).
"""

from kstore.schemas.formats import EncodeError, Formats, WireFormatError
from kstore.schemas.models import ModelError
from kstore.schemas.registry import Registry, UnknownSchemaError
from kstore.schemas.specs import Avro, JsonSchema, Protobuf, Schema

__all__ = [
    "Avro",
    "EncodeError",
    "Formats",
    "JsonSchema",
    "ModelError",
    "Protobuf",
    "Registry",
    "Schema",
    "UnknownSchemaError",
    "WireFormatError",
]
