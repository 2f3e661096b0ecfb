"""A worker pointed at a schema registry that knows none of its records' schema ids (the wrong one, or
one a restart emptied) waits as for a registry that does not answer: nothing is dead-lettered or sent
to the dead-letter topic, ``/readyz`` says why and the log says it once. Started again against the
right registry, it processes every record exactly once. On real Kafka, PostgreSQL and two real
registries (Apicurio)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kstore_devbroker.registry import DevRegistry
from tests.integration.schemas.test_schemas_end_to_end import dead_letters, health, order, wait_committed
from tests.support.harness import (
    assert_exactly_once,
    effects,
    outbox_rows,
    read_committed_records,
    stored_offsets,
    wait_until,
)
from tests.support.schema_data import ORDER_V1, registry_client

pytestmark = pytest.mark.integration

GROUP = "avro-orders"
#: How long the worker keeps meeting the empty registry before it is looked at: several retries.
WAIT_S = 6


@pytest.fixture
def empty_registry() -> Iterator[DevRegistry]:
    """A second registry of this test's own, empty (a throwaway data folder), like a staging URL or a
    development registry restarted without its storage."""
    with DevRegistry() as registry:
        yield registry


def start_worker(workers: Any, dsn: str, source: str, out: str, dlt: str, registry_url: str) -> Any:
    return workers(dsn, source, GROUP, "schema_processors:AvroOrders", env={"KSTORE_TEST_OUT_TOPIC": out},
                   args=["--schema-registry-url", registry_url, "--max-batch-size", "100", "--metrics-port", "0",
                         "--dead-letter-topic", dlt])


def test_a_registry_that_knows_none_of_the_ids_is_waited_out_and_nothing_is_dead_lettered(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any, kafka: str, schema_registry: DevRegistry,
        empty_registry: DevRegistry) -> None:
    source, out, dlt = new_topic(partitions=2), new_topic(partitions=1), new_topic(partitions=1)
    write = AvroSerializer(registry_client(schema_registry.url), ORDER_V1)
    context = SerializationContext(source, MessageField.VALUE)
    sent = produce(source, [write(order(i), context) for i in range(300)])

    w1 = start_worker(workers, pg_dsn, source, out, dlt, empty_registry.url)
    w1.wait_for_log(r"knows no schema at all", timeout=90)
    time.sleep(WAIT_S)  # it keeps retrying meanwhile

    metrics = health(w1, "/metrics")[1]
    attempts = re.search(rf'kstore_batches_rolled_back_total\{{group="{GROUP}",reason="schema_registry"\}} (\d+)',
                         metrics)
    assert attempts is not None and float(attempts.group(1)) >= 3, "the batch is not being retried"
    status, why = health(w1, "/readyz")
    assert status == 503, (status, why)
    assert f"the schema registry at {empty_registry.url} knows no schema at all" in why
    assert "is it the right registry, or was it emptied?" in why and f"the records of topic {source} name" in why
    warnings = re.findall(r"WARNING kstore\.engine\.waits: the schema registry at \S+ knows no schema at all.*"
                          r"nothing is dead-lettered", w1.log)
    assert len(warnings) == 1, w1.log[-3000:]
    assert dead_letters(pg_dsn, GROUP) == []
    assert not effects(pg_dsn, "orders_seen") and not any(stored_offsets(pg_dsn, GROUP).values())
    assert w1.terminate() == 0

    w2 = start_worker(workers, pg_dsn, source, out, dlt, schema_registry.url)
    wait_committed(pg_dsn, GROUP, sent)
    assert_exactly_once(effects(pg_dsn, "orders_seen"), set(sent))
    assert dead_letters(pg_dsn, GROUP) == []
    wait_until(lambda: outbox_rows(pg_dsn) == 0, 90, interval=0.5, what="every produced record published")
    assert w2.terminate() == 0
    assert read_committed_records(kafka, dlt) == [], "a record reached the dead-letter topic"
    assert len(read_committed_records(kafka, out)) == len(sent)
