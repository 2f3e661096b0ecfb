"""The development schema registry is a real Confluent-compatible registry: Confluent's own client
and Avro serializers work against it, and its schemas and their ids survive a restart (the command's
by default, in ``.kstore-dev/registry``; ``--temp`` for a throwaway one)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from kstore_devbroker.registry import DevRegistry
from tests.support.schema_data import registry_client

ORDER = json.dumps({
    "type": "record",
    "name": "Order",
    "namespace": "kstore.test",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount", "type": ["null", "double"], "default": None},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
    ],
})
REFUND = json.dumps({
    "type": "record",
    "name": "Refund",
    "namespace": "kstore.test",
    "fields": [{"name": "order_id", "type": "long"}, {"name": "reason", "type": "string"}],
})
REPO = Path(__file__).resolve().parents[3]
# Requests to 127.0.0.1 never go through a proxy named in the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _client(registry: DevRegistry) -> SchemaRegistryClient:
    """A new client: nothing cached, so every lookup asks the registry. No retries: a registry
    that is down fails the first request."""
    return registry_client(registry.url, **{"max.retries": 0})


def _get(url: str) -> Any:
    with _HTTP.open(url, timeout=10) as response:
        return json.loads(response.read())


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def test_avro_round_trip_through_the_registry(schema_registry: DevRegistry) -> None:
    topic = _unique("orders")
    ctx = SerializationContext(topic, MessageField.VALUE)
    serialize = AvroSerializer(_client(schema_registry), ORDER)  # registers the schema on first use
    record = {"id": 7, "customer": "ada", "amount": 12.5, "tags": ["new", "priority"]}

    data = serialize(record, ctx)

    assert data is not None and data[0] == 0  # Confluent's framing: magic byte, then the schema id
    schema_id = int.from_bytes(data[1:5], "big")
    # The registry itself holds it, under TopicNameStrategy's subject.
    assert _get(f"{schema_registry.url}/subjects/{topic}-value/versions/latest")["id"] == schema_id
    assert json.loads(_get(f"{schema_registry.url}/schemas/ids/{schema_id}")["schema"]) == json.loads(ORDER)
    # Another client, with nothing cached, reads the writer's schema back from the registry by id.
    assert AvroDeserializer(_client(schema_registry))(data, ctx) == record


def test_a_stopped_registry_does_not_answer_and_comes_back_with_its_schemas(schema_registry: DevRegistry) -> None:
    subject = _unique("outage") + "-value"
    schema_id = _client(schema_registry).register_schema(subject, Schema(ORDER, "AVRO"))
    url = schema_registry.url
    try:
        schema_registry.stop()

        assert not schema_registry.running
        with pytest.raises(urllib.error.URLError) as refused:
            _get(f"{url}/schemas/ids/{schema_id}")
        assert isinstance(refused.value.reason, ConnectionRefusedError)  # no HTTP answer at all
        with pytest.raises(Exception) as failed:
            _client(schema_registry).get_schema(schema_id)
        assert not isinstance(failed.value, SchemaRegistryError)  # a transport error, not an answer

        schema_registry.start()
    finally:
        if not schema_registry.running:
            schema_registry.start()  # the next tests of this process need it

    assert schema_registry.url == url
    client = _client(schema_registry)
    assert json.loads(client.get_schema(schema_id).schema_str) == json.loads(ORDER)
    assert client.get_latest_version(subject).schema_id == schema_id
    assert client.register_schema(subject, Schema(ORDER, "AVRO")) == schema_id  # found by content, not new
    new_id = client.register_schema(_unique("refunds") + "-value", Schema(REFUND, "AVRO"))
    assert new_id != schema_id
    assert json.loads(client.get_schema(new_id).schema_str) == json.loads(REFUND)


def test_a_killed_registry_keeps_what_it_acknowledged() -> None:
    """Every commit reaches the database file at once: a crash right after a registration loses
    nothing, so a restarted registry never hands out an id it had already given."""
    with DevRegistry() as registry:
        subject = _unique("crash") + "-value"
        schema_id = _client(registry).register_schema(subject, Schema(ORDER, "AVRO"))

        registry.stop(kill=True)
        registry.start()

        client = _client(registry)
        assert client.get_latest_version(subject).schema_id == schema_id
        new_id = client.register_schema(_unique("after-crash") + "-value", Schema(REFUND, "AVRO"))
        assert new_id != schema_id
        assert json.loads(client.get_schema(schema_id).schema_str) == json.loads(ORDER)
        data_dir = registry.data_dir
    assert not registry.running and not data_dir.exists()  # a temporary data folder goes with it


def _run_registry(cwd: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``python -m kstore_devbroker run-registry`` started in ``cwd``, and the URL it printed once serving."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-m", "kstore_devbroker", "run-registry", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    url = proc.stdout.readline().strip() if ready else ""
    if not url.startswith("http://"):
        proc.kill()
        raise AssertionError(f"run-registry printed no URL: {url!r} {proc.communicate(timeout=30)}")
    return proc, url


def _stop(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C, as a person stops it; what it said on stderr."""
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def test_run_registry_keeps_its_schemas_across_a_restart_by_default(tmp_path: Path) -> None:
    subject = _unique("orders") + "-value"
    proc, url = _run_registry(tmp_path)
    try:
        schema_id = registry_client(url, **{"max.retries": 0}).register_schema(subject, Schema(ORDER, "AVRO"))
    finally:
        said = _stop(proc)

    proc, url = _run_registry(tmp_path)
    try:
        client = registry_client(url, **{"max.retries": 0})
        assert client.get_subjects() == [subject]
        assert client.get_latest_version(subject).schema_id == schema_id
        assert json.loads(client.get_schema(schema_id).schema_str) == json.loads(ORDER)
    finally:
        _stop(proc)
    assert f"schemas in {tmp_path / '.kstore-dev' / 'registry'}, kept across restarts" in said


def test_run_registry_with_temp_starts_empty_and_leaves_nothing(tmp_path: Path) -> None:
    proc, url = _run_registry(tmp_path, "--temp")
    try:
        client = registry_client(url, **{"max.retries": 0})
        assert client.get_subjects() == []
        client.register_schema(_unique("orders") + "-value", Schema(ORDER, "AVRO"))
    finally:
        said = _stop(proc)
    kept = re.search(r"schemas in (\S+), deleted when it stops", said)
    assert kept is not None, said
    assert not Path(kept.group(1)).exists() and not (tmp_path / ".kstore-dev").exists()
