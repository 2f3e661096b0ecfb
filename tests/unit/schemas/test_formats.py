"""Reading and writing the registry formats, on confluent-kafka's in-memory registry: the wire
format, schema evolution, typed models, and which failures are a record's and which an outage's."""

from __future__ import annotations

import json
import socket

import pytest
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kstore.errors import ConfigurationError, RegistryUnavailableError
from kstore.schemas import Avro, EncodeError, Formats, JsonSchema, ModelError, Protobuf, Registry, WireFormatError
from kstore.schemas.registry import UnknownSchemaError
from kstore.settings import Settings
from tests.support.schema_data import (
    ORDER_EVENT,
    ORDER_JSON_SCHEMA,
    ORDER_NEEDS_COUPON,
    ORDER_V1,
    ORDER_V2,
    OrderModel,
    OrderRecord,
    protobuf_order_class,
)

ORDER = {"id": 7, "customer": "c7", "amount": 12.5}


@pytest.fixture
def registry() -> Registry:
    return Registry.in_memory()


def formats(registry: Registry, **declared: object) -> Formats:
    return Formats(**declared, registry=lambda: registry)  # type: ignore[arg-type]


def test_avro_round_trips_through_the_wire_format(registry: Registry) -> None:
    data = formats(registry).encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    assert data is not None and data[0] == 0
    schema_id = int.from_bytes(data[1:5], "big")
    assert registry.client.get_schema(schema_id).schema_str is not None
    assert formats(registry, value_format="avro").decode(None, data) == (None, ORDER)
    # What confluent-kafka's own deserializer reads from the same bytes.
    context = SerializationContext("orders", MessageField.VALUE)
    assert AvroDeserializer(registry.client)(data, context) == ORDER


def test_avro_keys_and_values_each_by_their_own_format(registry: Registry) -> None:
    writer = formats(registry)
    key = writer.encode("orders", {"id": 7, "customer": "c7", "amount": 0.0}, Avro(ORDER_V1), is_key=True)
    value = writer.encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    assert registry.client.get_subjects() == ["orders-key", "orders-value"]
    key_read, value_read = formats(registry, key_format="avro", value_format="avro").decode(key, value)
    assert key_read["amount"] == 0.0 and value_read == ORDER


def test_a_reader_schema_resolves_records_of_an_older_and_a_newer_writer(registry: Registry) -> None:
    writer = formats(registry)
    old = writer.encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    new = writer.encode("orders", {**ORDER, "currency": "USD"}, Avro(ORDER_V2), is_key=False)
    as_written = formats(registry, value_format="avro")
    assert as_written.decode(None, old)[1] == ORDER
    assert as_written.decode(None, new)[1] == {**ORDER, "currency": "USD"}
    v2_reader = formats(registry, value_format="avro", value_schema=ORDER_V2)
    assert v2_reader.decode(None, old)[1] == {**ORDER, "currency": "EUR"}  # the default fills the new field
    v1_reader = formats(registry, value_format="avro", value_schema=ORDER_V1)
    assert v1_reader.decode(None, new)[1] == ORDER  # the new field is skipped


def test_a_record_the_reader_cannot_resolve_is_the_records_fault(registry: Registry) -> None:
    old = formats(registry).encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    with pytest.raises(WireFormatError, match="does not decode as Avro with schema id"):
        formats(registry, value_format="avro", value_schema=ORDER_NEEDS_COUPON).decode(None, old)


@pytest.mark.parametrize("data, error", [
    (b'{"id": 7}', "not in the Confluent wire format"),
    (b"\x00\x00", "not in the Confluent wire format"),
    (b"\x01\x00\x00\x00\x01abc", "not in the Confluent wire format"),
])
def test_bytes_not_in_the_wire_format_are_the_records_fault(registry: Registry, data: bytes, error: str) -> None:
    with pytest.raises(WireFormatError, match=error):
        formats(registry, value_format="avro").decode(None, data)


def test_an_unknown_schema_id_is_the_records_fault(registry: Registry) -> None:
    with pytest.raises(UnknownSchemaError, match="schema id 4242 is not in the schema registry"):
        formats(registry, value_format="avro").decode(None, b"\x00" + (4242).to_bytes(4, "big") + b"\x02")


def test_a_payload_that_does_not_decode_is_the_records_fault_and_its_contents_are_not_shown(registry: Registry) -> None:
    good = formats(registry).encode("orders", {**ORDER, "customer": "secret-customer"}, Avro(ORDER_V1), is_key=False)
    assert good is not None
    with pytest.raises(WireFormatError) as raised:
        formats(registry, value_format="avro").decode(None, good[:8])
    assert "secret" not in str(raised.value) and "schema id" in str(raised.value)


def test_a_tombstone_stays_none(registry: Registry) -> None:
    assert formats(registry, key_format="avro", value_format="avro").decode(None, None) == (None, None)


@pytest.mark.parametrize("model", [OrderModel, OrderRecord])
def test_typed_values_are_made_into_the_model(registry: Registry, model: type) -> None:
    data = formats(registry).encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    value = formats(registry, value_format="avro", value_model=model).decode(None, data)[1]
    assert isinstance(value, model) and (value.id, value.customer, value.currency) == (7, "c7", "EUR")


@pytest.mark.parametrize("model", [OrderModel, OrderRecord])
def test_a_value_that_does_not_fit_its_model_names_the_field_and_not_the_value(registry: Registry,
                                                                                model: type) -> None:
    reader = formats(registry, value_format="json", value_model=model)
    with pytest.raises(ModelError) as raised:
        reader.decode(None, json.dumps({"id": "not-a-number", "customer": "secret-c", "amount": 1}).encode())
    text = str(raised.value)
    assert "id" in text and model.__name__ in text and "secret-c" not in text and "not-a-number" not in text


def test_a_value_missing_a_required_field_does_not_fit(registry: Registry) -> None:
    with pytest.raises(ModelError, match="customer"):
        formats(registry, value_format="json", value_model=OrderModel).decode(None, b'{"id": 1, "amount": 2}')


def test_typed_values_produced_are_written_as_records(registry: Registry) -> None:
    writer = formats(registry)
    for typed in (OrderModel(id=7, customer="c7", amount=12.5), OrderRecord(7, "c7", 12.5)):
        data = writer.encode("orders", typed, Avro(ORDER_V2), is_key=False)
        assert formats(registry, value_format="avro").decode(None, data)[1] == {**ORDER, "currency": "EUR"}


def test_a_produced_value_that_does_not_fit_its_schema_fails_without_its_contents(registry: Registry) -> None:
    with pytest.raises(EncodeError) as raised:
        formats(registry).encode("events", {"order_id": "secret-id", "total_cents": 5}, Avro(ORDER_EVENT),
                                 is_key=False)
    assert "does not fit its avro schema" in str(raised.value) and "secret-id" not in str(raised.value)


def test_json_schema_round_trips_and_validates(registry: Registry) -> None:
    writer = formats(registry)
    data = writer.encode("orders", ORDER, JsonSchema(ORDER_JSON_SCHEMA), is_key=False)
    assert formats(registry, value_format="json-schema").decode(None, data)[1] == ORDER
    typed = formats(registry, value_format="json-schema", value_model=OrderModel).decode(None, data)[1]
    assert isinstance(typed, OrderModel) and typed.amount == 12.5
    with pytest.raises(EncodeError):
        writer.encode("orders", {"id": "x"}, JsonSchema(ORDER_JSON_SCHEMA), is_key=False)


def test_protobuf_round_trips(registry: Registry) -> None:
    order_class = protobuf_order_class()
    data = formats(registry).encode("orders", order_class(id=7, customer="c7", amount=12.5), Protobuf(order_class),
                                    is_key=False)
    value = formats(registry, value_format="protobuf", value_model=order_class).decode(None, data)[1]
    assert isinstance(value, order_class) and (value.id, value.customer, value.amount) == (7, "c7", 12.5)


def test_a_protobuf_record_with_an_unknown_schema_id_is_the_records_fault(registry: Registry) -> None:
    order_class = protobuf_order_class()
    payload = order_class(id=7, customer="c7", amount=12.5).SerializeToString()
    reader = formats(registry, value_format="protobuf", value_model=order_class)
    with pytest.raises(UnknownSchemaError):
        reader.decode(None, b"\x00" + (4242).to_bytes(4, "big") + b"\x00" + payload)


def test_protobuf_needs_its_message_class() -> None:
    with pytest.raises(ConfigurationError, match="value_model = the message class"):
        Formats(value_format="protobuf")


def test_a_model_needs_a_structured_format() -> None:
    with pytest.raises(ConfigurationError, match="structured value_format"):
        Formats(value_format="str", value_model=OrderModel)


def test_an_unknown_format_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="value_format must be one of"):
        Formats(value_format="xml")


def test_a_registry_format_without_a_registry_says_which_setting_is_missing() -> None:
    with pytest.raises(ConfigurationError, match="set schema_registry_url"):
        Formats(value_format="avro").decode(None, b"\x00\x00\x00\x00\x01\x02")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_registry_that_does_not_answer_is_an_outage_not_the_records_fault() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    registry = Registry.of(Settings(schema_registry_url=url, schema_registry_timeout_s=2))
    with pytest.raises(RegistryUnavailableError, match="does not answer"):
        formats(registry, value_format="avro").decode(None, b"\x00\x00\x00\x00\x01\x02")
    with pytest.raises(RegistryUnavailableError):
        formats(registry).encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    with pytest.raises(RegistryUnavailableError):
        registry.check()


def test_credentials_never_show_in_the_registrys_url() -> None:
    registry = Registry.of(Settings(schema_registry_url="https://key:s3cret@registry.example:8081/api",
                                    schema_registry_password="other-secret"))
    assert registry.url == "https://registry.example:8081/api"
    assert "s3cret" not in repr(Settings(schema_registry_password="s3cret"))


def test_an_edit_given_decoded_is_written_with_the_schema_of_the_original(registry: Registry) -> None:
    from kstore.schemas.formats import encode_like

    original = formats(registry).encode("orders", ORDER, Avro(ORDER_V1), is_key=False)
    assert original is not None
    reader = formats(registry, value_format="avro")
    edited = encode_like(reader, original, json.dumps({**ORDER, "id": 8}).encode(), is_key=False)
    assert edited[:5] == original[:5]  # the same schema id
    assert reader.decode(None, edited)[1] == {**ORDER, "id": 8}
    assert encode_like(reader, original, original, is_key=False) == original  # wire bytes stay as given
    with pytest.raises(ConfigurationError, match="does not fit its Avro schema"):
        encode_like(reader, original, b'{"id": "eight"}', is_key=False)
    with pytest.raises(ConfigurationError, match="decoded avro as JSON text"):
        encode_like(reader, original, b"{oops", is_key=False)
    plain = formats(registry, value_format="json")
    assert encode_like(plain, b"{}", b'{"a": 1}', is_key=False) == b'{"a": 1}'  # not a registry format


def test_an_edit_of_a_letter_not_in_the_wire_format_says_how_to_give_its_bytes(registry: Registry) -> None:
    from kstore.schemas.formats import encode_like

    reader = formats(registry, value_format="avro")
    raw = json.dumps(ORDER).encode()  # produced as JSON by mistake: it names no schema
    with pytest.raises(ConfigurationError, match=r"value was not written in the schema registry's wire format, "
                                                 r"so it names no schema .*--value-file: a zero byte"):
        encode_like(reader, raw, json.dumps({**ORDER, "id": 8}).encode(), is_key=False)
    with pytest.raises(ConfigurationError, match=r"key has no schema .*with its key as it is"):
        encode_like(formats(registry, key_format="avro"), None, b'"k"', is_key=True)


def test_a_password_in_the_registrys_url_is_a_secret_to_mask() -> None:
    settings = Settings(schema_registry_url="https://key:s3cret@a.example,https://b.example",
                        schema_registry_password="other")
    assert {"s3cret", "other"} <= set(settings.secrets)


@pytest.mark.parametrize("strategy, subject", [
    ("topic", "events-value"), ("record", "shop.OrderAccepted"), ("topic_record", "events-shop.OrderAccepted"),
])
def test_a_produced_schema_is_registered_under_its_naming_strategys_subject(registry: Registry, strategy: str,
                                                                           subject: str) -> None:
    schema = Avro(ORDER_EVENT, subject_name_strategy=strategy)
    data = formats(registry).encode("events", {"order_id": 1, "total_cents": 5}, schema, is_key=False)
    assert registry.client.get_subjects() == [subject]
    assert formats(registry, value_format="avro").decode(None, data)[1] == {"order_id": 1, "total_cents": 5}


def test_without_auto_register_a_schema_must_be_registered_already(registry: Registry) -> None:
    with pytest.raises(EncodeError, match="refused"):
        formats(registry).encode("events", {"order_id": 1, "total_cents": 5}, Avro(ORDER_EVENT, auto_register=False),
                                 is_key=False)
    formats(registry).encode("events", {"order_id": 1, "total_cents": 5}, Avro(ORDER_EVENT), is_key=False)
    assert formats(registry).encode("events", {"order_id": 2, "total_cents": 5}, Avro(ORDER_EVENT, auto_register=False),
                                    is_key=False) is not None
