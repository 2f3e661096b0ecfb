"""A worker whose processor needs the schema registry starts only with one that answers: otherwise
one line on stderr and exit 2, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from tests.support.harness import SUPPORT_DIR

pytestmark = pytest.mark.integration


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kstore", "worker", "schema_processors:AvroOrders", "--topic", "orders", *args]
    return subprocess.run(command,
                          cwd=SUPPORT_DIR, text=True, capture_output=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_registry_that_does_not_answer_stops_the_start_with_one_line(pg_dsn: str, kafka: str) -> None:
    url = f"http://user:s3cret@127.0.0.1:{closed_port()}"
    done = worker("--dsn", pg_dsn, "--bootstrap-servers", kafka, "--schema-registry-url", url)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("kstore: error: the schema registry at http://127.0.0.1:")
    assert "does not answer" in lines[-1]
    assert "Traceback" not in done.stderr and "s3cret" not in done.stderr


def test_an_address_that_is_not_a_registrys_api_stops_the_start_with_one_line(
        pg_dsn: str, kafka: str, schema_registry: Any) -> None:
    done = worker("--dsn", pg_dsn, "--bootstrap-servers", kafka,
                  "--schema-registry-url", schema_registry.url + "/not-the-api")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("kstore: error: the schema registry at http://127.0.0.1:"), done.stderr
    assert "does not list its subjects (HTTP 404" in lines[-1] and "the registry's API?" in lines[-1]
    assert "Traceback" not in done.stderr


def test_a_registry_format_without_a_registry_says_which_setting_is_missing(pg_dsn: str, kafka: str) -> None:
    done = worker("--dsn", pg_dsn, "--bootstrap-servers", kafka)
    assert done.returncode == 2
    assert "set schema_registry_url (--schema-registry-url, KSTORE_SCHEMA_REGISTRY_URL)" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr
