"""How one processor's keys and values are read (``key_format``, ``value_format``, ``value_model``)
and what it produces with a schema is written: :class:`Formats`.

Reading Avro is kstore's own short path over fastavro: the writer's schema is fetched once per
schema id (the registry client caches it) and parsed once, and each record is one
``schemaless_reader`` call, a few times cheaper than confluent-kafka's ``AvroDeserializer``, which
works out the subject and its rules per record. A schema with references goes through that
deserializer instead. Protobuf and JSON Schema use confluent-kafka's deserializers. Data-contract
rules (Confluent's ``ruleSet``) are not run when reading.

What fails to decode is the record's fault (it is dead-lettered, or stops the worker, by policy);
a registry that does not answer is an outage (:class:`~kstore.RegistryUnavailableError`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any, cast

from kstore.errors import ConfigurationError, ProcessorContractError, RegistryUnavailableError
from kstore.settings import Settings

from .models import model_reader, plain
from .registry import Registry, UnknownSchemaError, needs_extras
from .specs import Schema

#: The formats read through a schema registry.
REGISTRY_FORMATS = ("avro", "protobuf", "json-schema")
FORMATS = ("bytes", "str", "json", *REGISTRY_FORMATS)

Reader = Callable[[bytes], Any]


def _no_subject(_context: Any, _record_name: Any) -> None:
    """Reading needs no subject: the record names its schema's id (and with no subject, confluent-kafka's
    deserializers neither look up the latest version nor run rules per record)."""
    return None


#: The deserializers' configuration: no subject (see :func:`_no_subject`).
NO_SUBJECT: dict[str, Any] = {"subject.name.strategy": _no_subject}


class WireFormatError(ValueError):
    """A key or value is not in the Confluent wire format its format needs."""


class EncodeError(ValueError):
    """A produced key or value does not fit its schema (or the registry refused the schema)."""


def schema_id(data: bytes, what: str) -> int:
    """The schema id of a key or value in the Confluent wire format (a zero byte, then 4 bytes)."""
    if len(data) < 5 or data[0] != 0:
        raise WireFormatError(f"the {what} is not in the Confluent wire format (a zero byte, then a 4-byte schema id)")
    return int.from_bytes(data[1:5], "big")


class _AvroReader:
    """Avro records by the schema id they carry (see the module's docstring)."""

    def __init__(self, registry: Registry, reader_schema: str | None, what: str) -> None:
        from fastavro import parse_schema

        self._registry = registry
        self._what = what
        self._reader_text = reader_schema
        self._reader = parse_schema(json.loads(reader_schema)) if reader_schema else None
        #: Per schema id: how to read a record written with it.
        self._by_id: dict[int, Reader] = {}

    def __call__(self, data: bytes) -> Any:
        sid = schema_id(data, self._what)
        read = self._by_id.get(sid)
        if read is None:
            read = self._by_id[sid] = self._load(sid)
        return read(data)

    def _load(self, sid: int) -> Reader:
        from fastavro import parse_schema, schemaless_reader

        schema = self._registry.schema(sid)
        if (schema.schema_type or "AVRO") != "AVRO":
            raise WireFormatError(f"schema id {sid} is a {schema.schema_type} schema, not Avro")
        if schema.references:
            return self._through_deserializer()
        writer = parse_schema(json.loads(schema.schema_str or "null"))
        reader, what = self._reader, self._what

        def read(data: bytes) -> Any:
            payload = io.BytesIO(data)
            payload.seek(5)
            try:
                return schemaless_reader(payload, writer, reader, False)
            except Exception as exc:  # fastavro raises many kinds (EOFError, ValueError, its own)
                raise WireFormatError(f"the {what} does not decode as Avro with schema id {sid}: "
                                      f"{_reason(exc)}") from None
        return read

    def _through_deserializer(self) -> Reader:
        from confluent_kafka.schema_registry.avro import AvroDeserializer

        deserializer = AvroDeserializer(self._registry.client, self._reader_text, conf=NO_SUBJECT)
        registry = self._registry
        return lambda data: registry.ask(lambda: deserializer(data, None))


def _reason(exc: BaseException) -> str:
    """Why fastavro could not read a record, without the record's contents: the error's kind, and its
    text only for a schema resolution (which names schemas, not data)."""
    if type(exc).__name__ == "SchemaResolutionError":
        return str(exc).splitlines()[0][:300]
    return type(exc).__name__


def _deserializer_reader(registry: Registry, deserializer: Callable[[bytes, Any], Any], what: str) -> Reader:
    """A confluent-kafka deserializer, its registry failures sorted, its decoding failures the record's."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    def read(data: bytes) -> Any:
        sid = schema_id(data, what)
        try:
            return registry.ask(lambda: deserializer(data, None))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise UnknownSchemaError(f"the {what}'s schema id {sid} is not in the schema registry",
                                         schema_id=sid, registry=registry) from None
            raise
    return read


class _KnownIds:
    """A reader that first checks the record's schema id is in the registry (asked once per id)."""

    def __init__(self, registry: Registry, read: Reader, what: str) -> None:
        self._registry, self._read, self._what = registry, read, what
        self._known: set[int] = set()

    def __call__(self, data: bytes) -> Any:
        sid = schema_id(data, self._what)
        if sid not in self._known:
            self._registry.schema(sid)
            self._known.add(sid)
        return self._read(data)


class Formats:
    """One processor's formats, bound to a registry when one of them needs it."""

    def __init__(self, key_format: str = "bytes", value_format: str = "bytes", value_model: Any = None,
                 value_schema: str | None = None, registry: Callable[[], Registry] | None = None) -> None:
        for name, fmt in (("key_format", key_format), ("value_format", value_format)):
            if fmt not in FORMATS:
                raise ConfigurationError(f"{name} must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self._registry_factory = registry
        self._registry: Registry | None = None
        #: Serializers by (schema, is key), made at the schema's first use.
        self._serializers: dict[tuple[Schema, bool], Callable[[Any, Any], bytes | None]] = {}
        self.key_format, self.value_format = key_format, value_format
        self.raw = key_format == value_format == "bytes" and value_model is None
        self._read_key = self._reader(key_format, None, None, "key")
        self._read_value = self._reader(value_format, value_model, value_schema, "value")
        self._check_model(value_format, value_model)

    @classmethod
    def of(cls, processor: Any, settings: Settings | None = None, registry: Registry | None = None) -> Formats:
        """The formats a processor declares; ``registry``, or the registry (made at its first use) of ``settings``."""
        factory: Callable[[], Registry] | None = None
        if registry is not None:
            factory = lambda: registry  # noqa: E731
        elif settings is not None and settings.schema_registry_url:
            factory = lambda: Registry.of(settings)  # noqa: E731
        return cls(processor.key_format, processor.value_format, getattr(processor, "value_model", None),
                   getattr(processor, "value_schema", None), factory)

    @property
    def uses_registry(self) -> bool:
        return self.key_format in REGISTRY_FORMATS or self.value_format in REGISTRY_FORMATS

    def registry(self) -> Registry:
        if self._registry is None:
            if self._registry_factory is None:
                Registry.of(Settings())  # raises the error that says which setting is missing
            self._registry = cast(Callable[[], Registry], self._registry_factory)()
        return self._registry

    # -- reading ------------------------------------------------------------------------

    def decode(self, key: bytes | None, value: bytes | None) -> tuple[Any, Any]:
        """A record's key and value as the processor declared them."""
        return (None if key is None else self._read_key(key)), (None if value is None else self._read_value(value))

    def _reader(self, fmt: str, model: Any, reader_schema: str | None, what: str) -> Reader:
        if fmt == "bytes":
            return _same
        if fmt == "str":
            read: Reader = _utf8
        elif fmt == "json":
            read = json.loads
        else:
            read = _Lazy(lambda: self._registry_reader(fmt, model, reader_schema, what))
            if fmt == "protobuf":
                return read  # the model is the generated class the deserializer builds
        to_model = model_reader(model)
        if to_model is None:
            return read
        return lambda data: to_model(read(data))

    def _registry_reader(self, fmt: str, model: Any, reader_schema: str | None, what: str) -> Reader:
        registry = self.registry()
        try:
            if fmt == "avro":
                return _AvroReader(registry, reader_schema, what)
            if fmt == "json-schema":
                from confluent_kafka.schema_registry.json_schema import JSONDeserializer

                return _deserializer_reader(
                    registry, JSONDeserializer(None, schema_registry_client=registry.client, conf=NO_SUBJECT), what)
            from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer

            # The generated class reads the payload; the registry is only asked whether the id exists
            # (once per id), as JSON text: some registries (Apicurio) cannot serve a Protobuf schema in
            # the serialized form confluent-kafka's deserializer asks for.
            conf = {**NO_SUBJECT, "use.deprecated.format": False}
            return _KnownIds(registry, _deserializer_reader(registry, ProtobufDeserializer(model, conf), what), what)
        except ImportError:
            raise needs_extras() from None

    @staticmethod
    def _check_model(value_format: str, model: Any) -> None:
        if value_format == "protobuf" and not hasattr(model, "DESCRIPTOR"):
            raise ConfigurationError("value_format = 'protobuf' needs value_model = the message class protoc "
                                     "generated (e.g. orders_pb2.OrderPlaced)")
        if model is not None and value_format in ("bytes", "str"):
            raise ConfigurationError(f"value_model needs a structured value_format (json, avro, json-schema, "
                                     f"protobuf), not {value_format!r}")

    # -- writing ------------------------------------------------------------------------

    def encode(self, topic: str, data: Any, schema: Schema, is_key: bool) -> bytes | None:
        """A produced key or value in the Confluent wire format of ``schema``; :class:`EncodeError` if it
        does not fit, :class:`~kstore.RegistryUnavailableError` if the registry does not answer."""
        if data is None:
            return None
        if self._registry_factory is None:
            raise ProcessorContractError(
                f"produce() with a {type(schema).__name__} schema needs a schema registry: set schema_registry_url")
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        from confluent_kafka.serialization import MessageField, SerializationContext

        registry = self.registry()
        serializer = self._serializers.get((schema, is_key))
        if serializer is None:
            serializer = self._serializers[schema, is_key] = schema.serializer(registry.client)
        what = "key" if is_key else "value"
        context = SerializationContext(topic, MessageField.KEY if is_key else MessageField.VALUE)
        try:
            return registry.ask(lambda: serializer(plain(data), context))
        except RegistryUnavailableError:
            raise
        except SchemaRegistryError as exc:
            raise EncodeError(f"the schema registry refused the {what}'s {schema.format} schema for {topic}: "
                              f"{exc.error_message} (HTTP {exc.http_status_code})") from None
        except Exception as exc:
            raise EncodeError(f"the {what} produced to {topic} does not fit its {schema.format} schema: "
                              f"{_mismatch(exc)}") from None


def _mismatch(exc: BaseException) -> str:
    """Why a value does not fit its schema, naming fields but not the value's contents."""
    fields = [getattr(error, "field", None) for error in getattr(exc, "errors", None) or ()]
    named = sorted({str(field) for field in fields if field})
    return type(exc).__name__ + (f" (fields: {', '.join(named)})" if named else "")


def _same(data: bytes) -> bytes:
    return data


def _utf8(data: bytes) -> str:
    return data.decode("utf-8")


class _Lazy:
    """A reader made at its first use: a processor whose format needs the registry asks it nothing
    until its first record."""

    def __init__(self, make: Callable[[], Reader]) -> None:
        self._make = make
        self._read: Reader | None = None

    def __call__(self, data: bytes) -> Any:
        if self._read is None:
            self._read = self._make()
        return self._read(data)




def formats_of(processor: Any) -> Formats:
    """The formats bound to ``processor`` (by :func:`bind`), or, unbound, its formats without a registry."""
    formats = vars(processor).get("_formats")
    if formats is None:
        formats = vars(processor)["_formats"] = Formats.of(processor)
    return cast(Formats, formats)


def bind(processor: Any, settings: Settings, registry: Registry | None = None) -> Formats:
    """Bind ``processor``'s formats to ``registry``, or that of ``settings`` (what runs a processor calls this
    first)."""
    formats = vars(processor)["_formats"] = Formats.of(processor, settings, registry)
    return formats


def _writer_schema(registry: Callable[[], Registry], data: bytes | None, what: str, fmt: str) -> tuple[int, Any]:
    if data is None or len(data) < 5 or data[0] != 0:
        # Nothing names a schema to write the edit with: say how to give the bytes themselves.
        how = ("give the bytes the processor should read with --value-file: a zero byte, the 4-byte schema "
               f"id, then the {fmt} body" if what == "value" else "replay it with its key as it is")
        had = "has no" if data is None else "was not written in the schema registry's wire format, so it names no"
        raise ConfigurationError(f"the dead letter's {what} {had} schema to write the edited {what} with: {how}")
    sid = schema_id(data, what)
    return sid, registry().schema(sid)


def encode_like(formats: Formats, original: bytes | None, edited: bytes, is_key: bool) -> bytes:
    """An operator's edit of a key or value (``kstore dead-letters replay --value``) in a registry format,
    given decoded (as JSON text), written with the schema the original carries: the processor reads
    the edit as it read the original. Bytes already in the wire format, and other formats, stay as given."""
    fmt = formats.key_format if is_key else formats.value_format
    what = "key" if is_key else "value"
    if fmt not in REGISTRY_FORMATS or edited[:1] == b"\x00":
        return edited
    if fmt == "protobuf":
        raise ConfigurationError(f"a protobuf {what} is edited as its wire bytes: give them with --value-file")
    try:
        data = json.loads(edited)
    except ValueError as exc:
        raise ConfigurationError(f"the edited {what} is the decoded {fmt} as JSON text, which this is not: "
                                 f"{exc}") from None
    sid, schema = _writer_schema(formats.registry, original, what, fmt)
    header = b"\x00" + sid.to_bytes(4, "big")
    if fmt == "json-schema":
        return header + json.dumps(data, separators=(",", ":")).encode()
    from fastavro import parse_schema, schemaless_writer

    out = io.BytesIO()
    try:
        schemaless_writer(out, parse_schema(json.loads(schema.schema_str or "null")), data)
    except Exception as exc:  # fastavro's validation raises several kinds
        raise ConfigurationError(
            f"the edited {what} does not fit its Avro schema (id {sid}): {_mismatch(exc)}") from None
    return header + out.getvalue()


def decoded_for_display(registry: Registry, data: bytes | None) -> tuple[str, Any] | None:
    """A dead letter's key or value decoded with the schema it names, for an operator to read:
    ``(description, value)``; None if it is not in the wire format, or is Protobuf (which needs its class)."""
    if data is None or len(data) < 5 or data[0] != 0:
        return None
    sid = schema_id(data, "value")
    schema = registry.schema(sid)
    kind = (schema.schema_type or "AVRO").upper()
    if kind == "AVRO":
        return f"avro, schema id {sid}", _AvroReader(registry, None, "value")(data)
    if kind == "JSON":
        return f"json-schema, schema id {sid}", json.loads(data[5:])
    return None
