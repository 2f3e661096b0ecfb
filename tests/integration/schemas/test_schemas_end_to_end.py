"""Schemas end to end, on real Kafka, PostgreSQL and a real schema registry (Apicurio, Confluent's API).

Avro orders are read by a worker (into a dataclass, as version 2 of their schema) and turned into
Avro events; the schema evolves mid-stream (a field added with a default); 50 payloads that do not
decode and 50 unknown schema ids are mixed in; the registry is stopped for 20 s mid-run while the
worker meets a schema id it has not read yet, and the worker is SIGKILLed. Every good order's effect
lands once, exactly the 100 bad records are dead-lettered (none for the outage), and a
``read_committed`` consumer reads every event once with confluent-kafka's own deserializer.
Protobuf and JSON Schema topics run the same way, shorter; and the operator's tools read and edit
a letter through its schema.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.support.harness import SUPPORT_DIR, effects, stored_offsets, wait_until
from tests.support.schema_data import ORDER_JSON_SCHEMA, ORDER_V1, ORDER_V2, protobuf_order_class, registry_client

pytestmark = pytest.mark.integration

#: An id no registry here hands out.
UNKNOWN_ID = 987_654
OUTAGE_S = 20


def order(i: int) -> dict[str, Any]:
    return {"id": i, "customer": f"c{i % 97}", "amount": (i % 1000) / 4}


def undecodable(schema_id: int) -> bytes:
    """A record that names a real schema but whose payload stops short of it."""
    return b"\x00" + schema_id.to_bytes(4, "big") + b"\x02"


def unknown_id() -> bytes:
    return b"\x00" + UNKNOWN_ID.to_bytes(4, "big") + b"\x02\x04"


def schema_id_of(data: bytes) -> int:
    return int.from_bytes(data[1:5], "big")


def read_events(kafka: str, topic: str, deserializer: Any, expected: int, timeout: float = 120) -> list[Any]:
    """Every event in ``topic`` as a ``read_committed`` confluent-kafka consumer reads it, decoded by
    confluent-kafka's own ``deserializer``: ``(key, event)``."""
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"reader-{time.monotonic_ns()}",
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    events: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(events) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 1.0):
                if msg.error():
                    continue
                context = SerializationContext(topic, MessageField.VALUE)
                events.append((msg.key().decode(), deserializer(msg.value(), context)))
        time.sleep(1)  # anything beyond the expected count (a duplicate) would arrive now
        events += [(m.key().decode(), deserializer(m.value(), SerializationContext(topic, MessageField.VALUE)))
                   for m in consumer.consume(1000, 2.0) if not m.error()]
    finally:
        consumer.close()
    return events


def dead_letters(dsn: str, group: str) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(
                "SELECT id, topic, partition_id, \"offset\", error FROM kstore_dead_letters WHERE consumer_group = :g"),
                {"g": group}).all())
    finally:
        engine.dispose()


def wait_committed(dsn: str, group: str, sent: Sequence[tuple[str, int, int]], timeout: float = 180) -> None:
    ends: dict[tuple[str, int], int] = {}
    for t, p, o in sent:
        ends[(t, p)] = max(ends.get((t, p), 0), o + 1)
    wait_until(lambda: all((stored_offsets(dsn, group).get(tp) or 0) >= end for tp, end in ends.items()),
               timeout, interval=0.5, what=f"every message of {group} committed")


def check_outcome(dsn: str, group: str, sent: Sequence[tuple[str, int, int]], good: Sequence[int],
                  bad: set[int], events: list[Any], ids: dict[int, int]) -> None:
    """Each good record's effect and event once; exactly the bad ones dead-lettered."""
    where = dict(enumerate(sent))
    counts = effects(dsn, "orders_seen")
    assert {where[i] for i in good} == set(counts), "an effect is missing, or a bad record has one"
    assert max(counts.values()) == 1, f"effects landed twice: {[k for k, v in counts.items() if v > 1][:5]}"
    letters = dead_letters(dsn, group)
    assert sorted((t, p, o) for _, t, p, o, _ in letters) == sorted(where[i] for i in bad)
    assert not [e for *_, e in letters if "registry" in e and "does not answer" in e], "an outage was dead-lettered"
    per_order = Counter(event["order_id"] for _, event in events)
    assert set(per_order) == {ids[i] for i in good} and max(per_order.values()) == 1, "an event is missing or twice"


def start_worker(workers: Any, dsn: str, topic: str, group: str, processor: str, registry_url: str,
                 out: str) -> Any:
    return workers(dsn, topic, group, processor, env={"KSTORE_TEST_OUT_TOPIC": out},
                   args=["--schema-registry-url", registry_url, "--max-batch-size", "500", "--metrics-port", "0"])


def health(w: Any, path: str) -> tuple[int, str]:
    """What the worker's ``path`` (/readyz, /metrics) answers."""
    w.wait_for_log(r"serving /metrics, /livez and /readyz on http://[^:]+:\d+")
    port = re.search(r"serving /metrics, /livez and /readyz on http://[^:]+:(\d+)", w.log).group(1)  # type: ignore[union-attr]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.long
def test_avro_orders_exactly_once_through_evolution_bad_records_a_registry_outage_and_a_kill(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str, schema_registry: Any) -> None:
    url = schema_registry.url
    source, out = new_topic(partitions=4), new_topic(partitions=2)
    client = registry_client(url)
    v1 = AvroSerializer(client, ORDER_V1)
    v2 = AvroSerializer(client, ORDER_V2)
    context = SerializationContext(source, MessageField.VALUE)
    # Every value made before anything runs: version 2's id is registered now, and met by the worker
    # for the first time while the registry is away.
    first = [v1(order(i), context) for i in range(10_000)]
    second = [v2({**order(i), "currency": "USD"}, context) for i in range(10_000, 20_000)]
    v1_id, v2_id = schema_id_of(first[0]), schema_id_of(second[0])
    assert v1_id != v2_id
    values: list[bytes] = []
    ids: dict[int, int] = {}  # position -> order id
    bad: set[int] = set()
    for half, (good_values, broken_id, offset) in enumerate(((first, v1_id, 0), (second, v2_id, 10_000))):
        for j, value in enumerate(good_values):
            if j % 400 == 7:  # 25 of each kind in each half, spread out
                bad.add(len(values))
                values.append(undecodable(broken_id) if half == 0 or j % 800 == 7 else unknown_id())
            if j % 400 == 207:
                bad.add(len(values))
                values.append(unknown_id() if half == 0 or j % 800 == 207 else undecodable(broken_id))
            ids[len(values)] = offset + j
            values.append(value)
    assert len(bad) == 100 and len(ids) == 20_000
    cut = values.index(second[0])
    sent = produce(source, values[:cut])
    w1 = start_worker(workers, pg_dsn, source, "avro-orders", "schema_processors:AvroOrders", url, out)
    wait_committed(pg_dsn, "avro-orders", sent)

    schema_registry.stop()
    try:
        sent += produce(source, values[cut:])
        w1.wait_for_log(r"the schema registry at \S+ does not answer", timeout=60)
        letters_before = len(dead_letters(pg_dsn, "avro-orders"))
        time.sleep(OUTAGE_S)  # the outage lasts: nothing of the second half may be dead-lettered meanwhile
        assert len(dead_letters(pg_dsn, "avro-orders")) == letters_before == 50
        status, why = health(w1, "/readyz")
        assert status == 503 and "the schema registry" in why and "does not answer" in why, (status, why)
        assert re.search(r'kstore_batches_rolled_back_total\{group="avro-orders",reason="schema_registry"\} [1-9]',
                         health(w1, "/metrics")[1])
    finally:
        schema_registry.start()
    w1.wait_for_log(r"the schema registry answers again", timeout=60)
    w1.wait_for_log(r"committed \d+ messages", timeout=60, count=2)
    w1.kill()
    w2 = start_worker(workers, pg_dsn, source, "avro-orders", "schema_processors:AvroOrders", url, out)
    wait_committed(pg_dsn, "avro-orders", sent)

    good = sorted(ids)
    events = read_events(kafka, out, AvroDeserializer(registry_client(url)), expected=len(good))
    check_outcome(pg_dsn, "avro-orders", sent, good, bad, events, ids)
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        currencies = dict(conn.execute(sa.text("SELECT currency, count(*) FROM orders_seen GROUP BY currency")).all())
    engine.dispose()
    assert currencies == {"EUR": 10_000, "USD": 10_000}, "version 1 records read as version 2 get the default"
    assert w2.terminate() == 0


def kstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", *args], cwd=SUPPORT_DIR, text=True, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR), **(env or {})}, timeout=120, check=False)


def with_bad_records(good_values: list[bytes], every: int = 100) -> tuple[list[bytes], dict[int, int], set[int]]:
    """The values with a bad record before every ``every``-th: an unknown schema id, or bytes not in the
    wire format, in turn; with each good value's position mapped to its order id."""
    values: list[bytes] = []
    ids: dict[int, int] = {}
    bad: set[int] = set()
    for j, value in enumerate(good_values):
        if j % every == every // 2:
            bad.add(len(values))
            values.append(unknown_id() if j % (2 * every) == every // 2 else b"not in the wire format")
        ids[len(values)] = j
        values.append(value)
    return values, ids, bad


def test_protobuf_orders_exactly_once_and_bad_records_dead_lettered(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str, schema_registry: Any) -> None:
    url = schema_registry.url
    source, out = new_topic(partitions=2), new_topic(partitions=2)
    order_class = protobuf_order_class()
    write = ProtobufSerializer(order_class, registry_client(url), {"use.deprecated.format": False})
    context = SerializationContext(source, MessageField.VALUE)
    values, ids, bad = with_bad_records([write(order_class(**order(i)), context) for i in range(1000)])
    sent = produce(source, values)
    w = start_worker(workers, pg_dsn, source, "protobuf-orders", "schema_processors:ProtobufOrders", url, out)
    wait_committed(pg_dsn, "protobuf-orders", sent)
    events = read_events(kafka, out, AvroDeserializer(registry_client(url)), expected=len(ids))
    check_outcome(pg_dsn, "protobuf-orders", sent, sorted(ids), bad, events, ids)
    assert w.terminate() == 0


def test_json_schema_orders_exactly_once_and_a_letter_read_and_edited_through_its_schema(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str, schema_registry: Any) -> None:
    url = schema_registry.url
    source, out = new_topic(partitions=2), new_topic(partitions=2)
    client = registry_client(url)
    context = SerializationContext(source, MessageField.VALUE)
    write = JSONSerializer(ORDER_JSON_SCHEMA, client)
    values, ids, bad = with_bad_records([write(order(i), context) for i in range(1000)])
    # Valid for the schema it was written with (any object), but not an order: the model refuses it.
    loose = JSONSerializer(json.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "title": "Loose",
                                       "type": "object"}), client,
                           conf={"subject.name.strategy": lambda ctx, name: f"{ctx.topic}-loose"})
    misfit = len(values)
    bad.add(misfit)
    values.append(loose({"id": "not-a-number", "customer": "c", "amount": 1}, context))
    sent = produce(source, values)
    w = start_worker(workers, pg_dsn, source, "json-schema-orders", "schema_processors:JsonSchemaOrders", url, out)
    wait_committed(pg_dsn, "json-schema-orders", sent)
    events = read_events(kafka, out, JSONDeserializer(None, schema_registry_client=client), expected=len(ids))
    check_outcome(pg_dsn, "json-schema-orders", sent, sorted(ids), bad, events, ids)
    assert w.terminate() == 0

    (letter_id, error), = [(i, e) for i, t, p, o, e in dead_letters(pg_dsn, "json-schema-orders")
                           if (t, p, o) == sent[misfit]]
    assert "does not fit OrderRecord" in error and "id" in error and "not-a-number" not in error
    shown = kstore("dead-letters", "show", str(letter_id), "--dsn", pg_dsn, "--schema-registry-url", url)
    assert shown.returncode == 0, shown.stderr
    assert '(json-schema, schema id' in shown.stdout and '"id": "not-a-number"' in shown.stdout
    edited = json.dumps({"id": 5000, "customer": "fixed", "amount": 2.5})
    replayed = kstore("dead-letters", "replay", "schema_processors:JsonSchemaOrders", "--group", "json-schema-orders",
                      "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--schema-registry-url", url,
                      "--id", str(letter_id), "--value", edited, "--reason", "fixed the id",
                      env={"KSTORE_TEST_OUT_TOPIC": out})
    assert replayed.returncode == 0, replayed.stderr
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT order_id FROM orders_seen WHERE topic = :t AND partition_id = :p "
                                   "AND kafka_offset = :o"), dict(zip("tpo", sent[misfit], strict=True))).one()
    engine.dispose()
    assert row.order_id == 5000
