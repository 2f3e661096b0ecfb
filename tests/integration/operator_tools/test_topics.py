"""``kstore topics create|list TOPIC...``: topics that no processor declares (an application outbox's),
named by themselves, through the Kafka client of ``kafka_client``. A processor (``MODULE:CLASS``, a
':' that no topic name has) keeps its form: tests/integration/outbox/test_output_topics.py."""

from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

import pytest

from tests.conftest import _has_leaders
from tests.integration.cli.test_cli import assert_one_clear_line, kstore

pytestmark = pytest.mark.integration


def table(r: subprocess.CompletedProcess[str]) -> list[list[str]]:
    assert r.returncode == 0, r.stderr
    return [line.split() for line in r.stdout.splitlines()[1:]]


def test_named_topics_are_created_and_one_already_there_with_those_partitions_is_left_as_it_is(
        kafka: str, kafka_client: str, new_topic: Any, admin: Any) -> None:
    there = new_topic(partitions=3)
    fresh = f"order-placed-{uuid.uuid4().hex[:8]}"
    made = kstore("topics", "create", fresh, there, "--partitions", "3", "--replication-factor", "1",
                  "--bootstrap-servers", kafka)
    assert table(made) == [[fresh, "-", "3", "created"], [there, "-", "3", "exists"]]
    assert _has_leaders(admin, fresh, 3)
    again = kstore("topics", "create", fresh, "--partitions", "3", "--bootstrap-servers", kafka)
    assert table(again) == [[fresh, "-", "3", "exists"]]
    listed = kstore("topics", "list", fresh, "missing-" + fresh, "--bootstrap-servers", kafka, "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [
        {"topic": fresh, "role": None, "partitions": 3, "created": False, "exists": True},
        {"topic": "missing-" + fresh, "role": None, "partitions": 0, "created": False, "exists": False}]


def test_a_named_topic_there_with_other_partitions_is_one_line_and_nothing_is_created(
        kafka: str, kafka_client: str, new_topic: Any) -> None:
    there = new_topic(partitions=2)
    fresh = f"order-placed-{uuid.uuid4().hex[:8]}"
    r = kstore("topics", "create", fresh, there, "--partitions", "3", "--bootstrap-servers", kafka)
    assert_one_clear_line(r, f"topic {there!r} exists at {kafka} with 2 partition(s), not 3")
    assert table(kstore("topics", "list", fresh, "--bootstrap-servers", kafka)) == [[fresh, "-", "-", "missing"]]


@pytest.mark.parametrize(("args", "said"), [
    (["examples/payments.py"], "'examples/payments.py' is neither a Kafka topic name"),
    (["order placed"], "'order placed' is neither a Kafka topic name"),
    (["topic_processors:Announcer", "order-placed"], "give one processor (MODULE:CLASS) or topic names"),
    (["order-placed", "--topic", "orders"], "--topic replaces a processor's input topics"),
    (["order-placed", "--partitions", "0"], "partitions must be at least 1"),
])
def test_what_is_neither_one_processor_nor_topic_names_is_one_line(kafka: str, args: list[str], said: str) -> None:
    assert_one_clear_line(kstore("topics", "create", *args, "--bootstrap-servers", kafka), said)
