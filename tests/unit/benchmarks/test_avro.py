"""The Avro pair (29: by hand with confluent-kafka's AvroDeserializer, 30: kstore's value_format = "avro")
is wired as its contenders' twins on bytes are, and both read the same row from the same value (no
broker, no database: confluent-kafka's in-memory registry)."""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import avro
from benchmarks.avro_loops import insert_sql
from benchmarks.cli import parse, registry_for
from benchmarks.contenders import BY_KEY, CONTENDERS, RATIOS, select
from benchmarks.kstore_loop import AvroBatchProcessor, avro_effects_table
from benchmarks.meter import Meter
from benchmarks.runner import Options, Runner
from benchmarks.spawn import BenchmarkError
from kstore import Settings
from kstore.testing import make_message

DSN = "postgresql+psycopg2://bench@127.0.0.1:1/bench"
REGISTRY = "http://127.0.0.1:1/apis/ccompat/v7"
HAND, KSTORE = BY_KEY["29"], BY_KEY["30"]


def test_the_pair_is_contender_19_and_23_on_avro_values_judged_against_each_other() -> None:
    assert (HAND.name, KSTORE.name) == ("exactly-once-by-hand-confluent-avro", "kstore-batch-confluent-avro")
    by_hand, kstore_batch = BY_KEY["19"], BY_KEY["23"]
    assert (HAND.client, HAND.tuning, HAND.own_offsets, HAND.writes_rows, HAND.kstore) == (
        by_hand.client, by_hand.tuning, True, True, False)
    assert (KSTORE.client, KSTORE.settings, KSTORE.writes_rows, KSTORE.kstore, KSTORE.own_offsets) == (
        kstore_batch.client, kstore_batch.settings, True, True, False)
    assert {c.number for c in CONTENDERS if c.workload == "avro"} == {29, 30}
    assert not HAND.throughput_only and not KSTORE.throughput_only
    judged = [(r.key, r.target) for r in RATIOS if 29 in (r.numerator, r.denominator) and r.target is not None]
    assert judged == [("30/29", 1.0)]
    assert len({r.section for r in RATIOS if r.key in ("30/29", "29/19", "30/23")}) == 1
    # The sweep tunes the bytes loops only: it never needs a registry.
    assert not HAND.entry.startswith("benchmarks.confluent_loops:")


def test_each_child_is_told_the_registry_and_kstore_gets_it_as_a_setting(tmp_path: Path) -> None:
    runner = Runner(Options(out=tmp_path), "127.0.0.1:1", DSN, [], registry_url=REGISTRY)
    try:
        hand = runner._config(HAND, "throughput", "topic", 10, "tag")
        assert (hand["workload"], hand["schema_registry_url"], hand["kstore_settings"]) == ("avro", REGISTRY, {})
        kstore = runner._config(KSTORE, "throughput", "topic", 10, "tag")
        assert kstore["workload"] == "avro"
        settings = Settings.from_env(dsn=DSN, **kstore["kstore_settings"])
        assert (settings.kafka_client, settings.schema_registry_url) == ("confluent", REGISTRY)
        bytes_twin = runner._config(BY_KEY["23"], "throughput", "topic", 10, "tag")
        assert bytes_twin["workload"] == "bytes" and "schema_registry_url" not in bytes_twin
        assert "schema_registry_url" not in bytes_twin["kstore_settings"]
    finally:
        runner.engine.dispose()


def test_an_avro_contender_without_a_registry_is_refused_before_anything_is_filled(tmp_path: Path) -> None:
    runner = Runner(Options(out=tmp_path), "127.0.0.1:1", DSN, [])
    try:
        with pytest.raises(BenchmarkError, match="schema registry"):
            runner.prepare([KSTORE])
    finally:
        runner.engine.dispose()


def test_a_registry_is_started_only_for_an_avro_contender_and_a_given_one_is_used(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import services

    def never() -> Any:
        raise AssertionError("no registry should be started")

    monkeypatch.setattr(services, "local_registry", never)
    _, args = parse(["--only", "19,23"])
    with registry_for(args, select("19,23")) as url:
        assert url is None
    _, args = parse(["--only", "29,30", "--schema-registry-url", REGISTRY])
    with registry_for(args, select("29,30")) as url:
        assert url == REGISTRY
    started: list[str] = []

    @contextlib.contextmanager
    def local() -> Any:
        started.append("registry")
        yield "http://local"

    monkeypatch.setattr(services, "local_registry", local)
    with registry_for(argparse.Namespace(schema_registry_url=None), select("30")) as url:
        assert url == "http://local" and started == ["registry"]


def _mock_registry() -> Any:
    from confluent_kafka.schema_registry._sync.mock_schema_registry_client import MockSchemaRegistryClient

    return MockSchemaRegistryClient({"url": "mock://bench"})


@pytest.mark.parametrize("size", [100, 300])
def test_both_read_the_same_row_from_a_value_of_the_workloads_size(size: int) -> None:
    """A value is ``--size`` bytes in the wire format; the hand-written loop's AvroDeserializer (called as
    its docs show) and kstore's own decoding read the same fields, which are the effects table's columns."""
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from kstore.schemas.formats import bind
    from kstore.schemas.registry import Registry

    client = _mock_registry()
    topic = "bench-avro"
    schema_id = client.register_schema(avro.subject(topic), Schema(avro.SCHEMA_STR, "AVRO"))
    values = avro.AvroValues(schema_id, size)
    before = time.time_ns()
    data = [values() for _ in range(3)]
    assert [len(v) for v in data] == [size] * 3
    assert all(v[:5] == b"\x00" + schema_id.to_bytes(4, "big") for v in data)

    by_hand = AvroDeserializer(client)(data[2], SerializationContext(topic, MessageField.VALUE))
    assert set(by_hand) == set(avro.FIELDS)
    assert before <= by_hand["id"] <= time.time_ns()

    processor = AvroBatchProcessor({"partitions": 1, "table": "bench_effects"}, Meter(3, latency=True))
    bind(processor, Settings(), Registry(client, "memory"))
    _, value = processor.deserialize(None, data[2])
    assert value == by_hand
    row = processor.row(make_message(value, topic=topic, partition=4, offset=7))
    assert row == {"partition_id": 4, "kafka_offset": 7, **by_hand}
    assert list(row) == [c.name for c in avro_effects_table("t").columns]

    # Each loop stamps a message done with its ``id``, the produce time.
    processor.stamp([make_message(value)])
    assert processor.meter._produced == [by_hand["id"]]


def test_the_tables_columns_agree_everywhere() -> None:
    names = [c.name for c in avro_effects_table("t").columns]
    assert names == ["partition_id", "kafka_offset", *avro.FIELDS]
    assert re.findall(r"(\w+) [a-z ]+ NOT NULL", avro.COLUMNS_SQL) == list(avro.FIELDS)
    assert f"({', '.join(names)})" in insert_sql({"table": "t"})


def test_the_meter_stamps_produce_times_as_the_bytes_values_carry_them() -> None:
    meter = Meter(2, latency=True)
    meter.stamp([b"%019d rest" % 1_000])
    meter.stamp_ns([2_000])
    assert meter._produced == [1_000, 2_000] and len(meter._done) == 2
