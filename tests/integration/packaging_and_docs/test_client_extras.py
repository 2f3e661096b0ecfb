"""The Kafka clients are extras: importing kstore imports neither, a client that is needed and not
installed is one line naming its extra (exit 2), and the operator's tools run on whichever client is
installed. Each test runs kstore in a process where a client library cannot be imported, as if it
were not installed (``sys.modules[name] = None``: nothing is uninstalled)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import SUPPORT_DIR

#: The module each client's library is imported as.
LIBRARY = {"confluent": "confluent_kafka", "kafka-python": "kafka"}

#: The client libraries' modules loaded in a process (those made unimportable are None there).
LOADED = ("sorted(m for m, v in sys.modules.items() "
          "if v is not None and m.split('.')[0] in ('kafka', 'confluent_kafka'))")


def python_without(libraries: tuple[str, ...], code: str, env: dict[str, str] | None = None,
                   timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter in which ``libraries`` cannot be imported."""
    blocked = f"import sys; sys.modules.update(dict.fromkeys({libraries!r}))\n"
    return subprocess.run([sys.executable, "-c", blocked + code], capture_output=True, text=True, timeout=timeout,
                          cwd=SUPPORT_DIR, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR),
                                              "KSTORE_CONNECT_TIMEOUT_S": "10", **(env or {})})


def kstore_without(libraries: tuple[str, ...], *args: str, env: dict[str, str] | None = None) -> \
        subprocess.CompletedProcess[str]:
    """The ``kstore`` command, in a process in which ``libraries`` cannot be imported."""
    code = (f"import runpy; sys.argv = ['kstore', *{list(args)!r}]\n"
            "runpy.run_module('kstore', run_name='__main__', alter_sys=True)")
    return python_without(libraries, code, env)


def migrated(tmp_path: Path) -> str:
    """A migrated SQLite database's DSN."""
    dsn = f"sqlite:///{tmp_path / 'k.db'}"
    assert kstore_without((), "migrate", "--dsn", dsn).returncode == 0
    return dsn


def assert_one_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.strip().splitlines() == [f"kstore: error: {expected}"], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def client_param(client: str) -> Any:
    """A test's parameter for the client left out."""
    return pytest.param(client, id=f"without-{client}")


def test_importing_kstore_and_its_command_imports_no_kafka_client() -> None:
    """A client library is imported only when the settings choose it, never by ``import kstore``."""
    code = ("import kstore, kstore.cli\n"
            f"print({LOADED})")
    result = python_without((), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("client", [client_param("confluent"), client_param("kafka-python")])
def test_a_worker_on_a_client_not_installed_is_one_line_naming_its_extra(client: str, tmp_path: Path) -> None:
    extra = {"confluent": "confluent-kafka", "kafka-python": "kafka-python"}[client]
    result = kstore_without((LIBRARY[client],), "worker", "processors:Recorder", "--topic", "t",
                            "--dsn", migrated(tmp_path), "--bootstrap-servers", "127.0.0.1:1",
                            env={"KSTORE_KAFKA_CLIENT": client})
    assert_one_line(result, f"kafka_client {client} needs {extra}: pip install 'kstore[{client}]'")


@pytest.mark.parametrize("client", [client_param("confluent"), client_param("kafka-python")])
def test_a_relay_on_a_client_not_installed_is_one_line_naming_its_extra(client: str, tmp_path: Path) -> None:
    extra = {"confluent": "confluent-kafka", "kafka-python": "kafka-python"}[client]
    result = kstore_without((LIBRARY[client],), "relay", "--group", "g", "--dsn", migrated(tmp_path),
                            "--bootstrap-servers", "127.0.0.1:1", env={"KSTORE_RELAY_CLIENT": client})
    assert_one_line(result, f"relay_client {client} needs {extra}: pip install 'kstore[{client}]'")


def test_the_operator_tools_with_no_client_installed_are_one_line(tmp_path: Path) -> None:
    result = kstore_without(("kafka", "confluent_kafka"), "offsets", "show", "--group", "g",
                            "--dsn", migrated(tmp_path), "--bootstrap-servers", "127.0.0.1:1",
                            env={"KSTORE_KAFKA_CLIENT": "kafka-python"})
    assert_one_line(result, "kafka_client kafka-python needs kafka-python: pip install 'kstore[kafka-python]'")


@pytest.mark.parametrize("client", [client_param("confluent"), client_param("kafka-python")])
def test_the_operator_tools_run_on_the_client_installed(client: str, kafka: str, new_topic: Any,
                                                        tmp_path: Path) -> None:
    """``kafka_client`` names a client not installed: ``kstore topics``' and ``offsets``' questions to
    the brokers (partitions, log bounds, the group's committed offsets and members) go to the other."""
    topic = new_topic(partitions=2)
    dsn, env = migrated(tmp_path), {"KSTORE_KAFKA_CLIENT": client}
    moved = kstore_without((LIBRARY[client],), "offsets", "set", "--group", "g", "--topic", topic, "--to-latest",
                           "--execute", "--reason", "test", "--dsn", dsn, "--bootstrap-servers", kafka, env=env)
    assert moved.returncode == 0, moved.stderr
    shown = kstore_without((LIBRARY[client],), "offsets", "show", "--group", "g", "--dsn", dsn,
                           "--bootstrap-servers", kafka, env=env)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[:2] for line in shown.stdout.splitlines() if line.startswith(topic)] == \
        [[topic, "0"], [topic, "1"]], shown.stdout


@pytest.mark.parametrize("client", [client_param("confluent"), client_param("kafka-python")])
def test_the_probe_and_the_tls_checks_need_no_client(client: str, tmp_path: Path) -> None:
    """A client-free module loads the TLS files (one line for a file that cannot be read) and probes
    the brokers (one line for a port where nothing listens), without either library."""
    code = ("from kstore import Settings, ConfigurationError, BrokerError\n"
            "from kstore.kafka.probe import probe\n"
            "from kstore.kafka.security import probe_config\n"
            f"bad = Settings(bootstrap_servers='127.0.0.1:1', security_protocol='SSL', ssl_cafile={str(tmp_path)!r})\n"
            "try:\n    probe_config(bad)\nexcept ConfigurationError as exc:\n    print('tls:', exc)\n"
            "s = Settings(bootstrap_servers='127.0.0.1:1')\n"
            "try:\n    probe(s, probe_config(s), sleep=lambda _s: None)\n"
            "except BrokerError as exc:\n    print('probe:', exc)\n"
            f"print({LOADED})")
    result = python_without((LIBRARY[client],), code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"tls: cannot load ssl_cafile {tmp_path}"), lines
    assert lines[1].startswith("probe: cannot reach Kafka at 127.0.0.1:1: connection refused"), lines
    assert LIBRARY[client] not in lines[2], lines
