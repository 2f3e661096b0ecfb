"""The worker's HTTP port (kstore.telemetry.health), served on this machine: each probe answers 200
or 503 with one line saying why, /metrics is the registry's, any other path a 404 naming the
three, and a port that cannot be bound is a configuration error naming it."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from kstore.errors import ConfigurationError
from kstore.telemetry.health import HealthServer, app


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def served() -> Iterator[tuple[int, dict[str, tuple[bool, str]]]]:
    """A server on a free port whose probes answer what the test puts in the dict."""
    registry = CollectorRegistry()
    Counter("kstore_test_things", "Things counted by the test.", registry=registry).inc(3)
    answers = {"livez": (True, "the batch loop and the fetch thread are turning"),
               "readyz": (False, "claiming 2 partitions")}
    server = HealthServer("127.0.0.1", 0, app(registry, lambda: answers["livez"], lambda: answers["readyz"])).start()
    try:
        yield server.port, answers
    finally:
        server.stop()


def test_each_probe_answers_its_status_and_one_line_saying_why(
        served: tuple[int, dict[str, tuple[bool, str]]]) -> None:
    port, answers = served
    assert get(port, "/livez") == (200, "ok: the batch loop and the fetch thread are turning\n")
    assert get(port, "/readyz") == (503, "unhealthy: claiming 2 partitions\n")
    answers["readyz"], answers["livez"] = (True, "2 partitions claimed"), (False, "the batch loop is stuck")
    assert get(port, "/readyz") == (200, "ok: 2 partitions claimed\n")
    assert get(port, "/livez") == (503, "unhealthy: the batch loop is stuck\n")


def test_metrics_are_the_registrys_and_another_path_names_the_three(
        served: tuple[int, dict[str, tuple[bool, str]]]) -> None:
    port, _ = served
    for path in ("/metrics", "/"):
        status, body = get(port, path)
        assert status == 200 and "kstore_test_things_total 3.0" in body, (path, body)
    assert get(port, "/nope") == (404, "not found: try /metrics, /livez or /readyz\n")


def test_a_port_taken_is_a_configuration_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=rf"cannot serve /metrics on 127\.0\.0\.1:{port} "
                                                     r"\(metrics_host, metrics_port\)"):
            HealthServer("127.0.0.1", port, app(CollectorRegistry(), lambda: (True, ""), lambda: (True, "")))
