"""A dead letter's page shows its value decoded with the schema it names, against a real schema
registry and PostgreSQL: Avro as JSON with the schema's id, bytes naming an id the registry does
not know as they are with the reason, and a plain value as its text."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from starlette.testclient import TestClient

from kstore import Settings
from kstore.console import app
from kstore.db import deadletters
from kstore.db.writes import now
from tests.support.schema_data import ORDER_V1, registry_client

pytestmark = pytest.mark.integration

GROUP = "decoded-letters"


def _letter(conn: sa.Connection, value: bytes) -> int:
    t = deadletters.build_table()
    return int(conn.execute(t.insert().returning(t.c.id), {
        "consumer_group": GROUP, "topic": "orders", "partition_id": 0, "offset": 7, "key": b"order-7",
        "value": value, "headers": "[]", "error": "ValueError: bad order", "traceback": "...", "attempts": 3,
        "first_failure_at": now(), "last_failure_at": now(), "status": deadletters.DEAD}).scalar_one())


def test_a_letters_page_shows_its_value_decoded_with_its_schema(pg_dsn: str, schema_registry: Any) -> None:
    client = registry_client(schema_registry.url)
    avro = AvroSerializer(client, ORDER_V1)(
        {"id": 7, "customer": "c7", "amount": 12.5}, SerializationContext("orders", MessageField.VALUE))
    assert avro is not None
    schema_id = int.from_bytes(avro[1:5], "big")
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:
        decoded, unknown, plain = (_letter(conn, v) for v in
                                   (avro, b"\x00" + (schema_id + 1000).to_bytes(4, "big") + b"\x02", b"plain text"))
    engine.dispose()
    settings = Settings(dsn=pg_dsn, bootstrap_servers="127.0.0.1:1", console_read_only=True,
                        console_sample_interval_s=0, schema_registry_url=schema_registry.url)

    with TestClient(app(settings, sample=False)) as web:
        page = web.get(f"/groups/{GROUP}/dead-letters/{decoded}").text
        assert f'id="value-schema">(avro, schema id {schema_id})' in page
        shown = re.search(r'<pre id="value">(.*?)</pre>', page, re.S)
        assert shown and json.loads(shown.group(1).replace("&#34;", '"')) == {"id": 7, "customer": "c7",
                                                                              "amount": 12.5}
        assert '<code id="key">order-7</code>' in page  # not in the wire format: its text

        page = web.get(f"/groups/{GROUP}/dead-letters/{unknown}").text
        assert 'id="value-schema"' not in page
        assert re.search(r'id="value-note">\(not decoded: [^<]*schema id ' + str(schema_id + 1000), page), page

        page = web.get(f"/groups/{GROUP}/dead-letters/{plain}").text
        assert '<pre id="value">plain text</pre>' in page and 'id="value-note"' not in page
