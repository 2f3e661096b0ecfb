"""Editing a dead letter of a schema'd processor (``kstore dead-letters replay --value``) whose value
never was in the registry's wire format, against a real schema registry and PostgreSQL: the operator
is told how to give the bytes, and the letter is left as it was."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from kstore import Settings
from kstore.db import deadletters
from kstore.db.writes import now
from tests.integration.cli.test_cli import assert_one_clear_line, kstore


def test_an_edit_of_a_value_that_names_no_schema_says_how_to_give_its_bytes_and_changes_nothing(
        pg_dsn: str, kafka: str, schema_registry: Any) -> None:
    t = deadletters.build_table()
    engine = sa.create_engine(pg_dsn)
    with engine.begin() as conn:  # produced as plain JSON by mistake: it did not decode as Avro
        letter_id = conn.execute(t.insert().returning(t.c.id), {
            "consumer_group": "avro-orders", "topic": "orders", "partition_id": 0, "offset": 3, "key": None,
            "value": json.dumps({"id": 3, "customer": "c3", "amount": 1.5}).encode(), "headers": "[]",
            "error": "WireFormatError: the value is not in the Confluent wire format", "traceback": "...",
            "attempts": 1, "first_failure_at": now(), "last_failure_at": now(),
            "status": deadletters.DEAD}).scalar_one()
    engine.dispose()
    r = kstore("dead-letters", "replay", "schema_processors:AvroOrders", "--group", "avro-orders",
               "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--schema-registry-url", schema_registry.url,
               "--id", str(letter_id), "--value", json.dumps({"id": 3, "customer": "c3", "amount": 2.5}),
               "--reason", "fix the amount", "--execute")
    assert_one_clear_line(r, "was not written in the schema registry's wire format", "--value-file",
                          "a zero byte, the 4-byte schema id, then the avro body")
    letter, history = deadletters.show_dead_letter(Settings(dsn=pg_dsn), letter_id)
    assert (letter.status, letter.attempts, letter.error, history) == (
        deadletters.DEAD, 1, "WireFormatError: the value is not in the Confluent wire format", [])
