"""A broker that cannot be there (nothing listens on its port, its name does not resolve) is one
line within seconds, after a brief retry (a broker restarting is back by then); a broker that
does not answer is still waited for, up to ``connect_timeout_s``. On either Kafka client."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.cli.test_cli import assert_one_clear_line, kstore

#: What the seam between the engine and a Kafka client promises: on each client.
pytestmark = [pytest.mark.contract, pytest.mark.usefixtures("kafka_client")]


#: The issue's bound: well under the 30 s a client waits for a broker that does not answer.
FAST_S = 5.0


def free_port() -> int:
    """A port nothing listens on (the kernel refuses connections to it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Result = subprocess.CompletedProcess[str]


def worker_against(servers: str, sqlite_dsn: str, timeout_s: str = "30") -> tuple[float, Result]:
    started = time.monotonic()
    r = kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--bootstrap-servers", servers, "--topic", "t",
               env={"KSTORE_CONNECT_TIMEOUT_S": timeout_s})
    return time.monotonic() - started, r


def test_a_refused_port_is_one_line_within_seconds(sqlite_dsn: str) -> None:
    port = free_port()
    took, r = worker_against(f"127.0.0.1:{port}", sqlite_dsn)
    assert_one_clear_line(r, f"cannot reach Kafka at 127.0.0.1:{port}: connection refused; check --bootstrap-servers",
                          "tried 3 times")
    assert took < FAST_S, f"took {took:.1f}s"


def test_a_name_that_does_not_resolve_is_one_line_within_seconds(sqlite_dsn: str) -> None:
    took, r = worker_against("no-such-broker.invalid:9092", sqlite_dsn)
    assert_one_clear_line(r, "cannot reach Kafka at no-such-broker.invalid:9092: the name 'no-such-broker.invalid' "
                             "does not resolve")
    assert took < FAST_S, f"took {took:.1f}s"


def test_every_address_is_named_when_none_can_be_there(sqlite_dsn: str) -> None:
    port = free_port()
    took, r = worker_against(f"127.0.0.1:{port},no-such-broker.invalid:9092", sqlite_dsn)
    assert_one_clear_line(r, f"127.0.0.1:{port}: connection refused; no-such-broker.invalid:9092: the name "
                             "'no-such-broker.invalid' does not resolve")
    assert took < FAST_S, f"took {took:.1f}s"


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A port that accepts connections and never says a word (a hung broker, a proxy to nowhere)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    listener.close()


def test_a_broker_that_does_not_answer_is_waited_for(sqlite_dsn: str, silent_broker: str) -> None:
    """Silence is not absence: the worker waits ``connect_timeout_s`` for it, as before."""
    took, r = worker_against(silent_broker, sqlite_dsn, timeout_s="3")
    assert_one_clear_line(r, f"cannot reach Kafka at {silent_broker}")
    assert "within 3s" in r.stderr
    assert took >= 3, f"took {took:.1f}s"


def test_a_broker_back_within_the_retries_is_used(sqlite_dsn: str, kafka: str, new_topic: Any,
                                                  workers: Any) -> None:
    """The brief retry: an address that refuses at first and answers a second later (a broker
    restarting; here a forwarder to the test broker that opens late) is not reported: the worker starts."""
    topic = new_topic(partitions=1)
    port = free_port()
    host, broker_port = kafka.rsplit(":", 1)
    stop = threading.Event()

    def forward() -> None:
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(0.2)
            while not stop.is_set():
                try:
                    client = server.accept()[0]
                except OSError:
                    continue
                upstream = socket.create_connection((host, int(broker_port)))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=forward, daemon=True)
    w = workers(sqlite_dsn, topic, "late-broker", args=["--bootstrap-servers", f"127.0.0.1:{port}"],
                env={"KSTORE_CONNECT_TIMEOUT_S": "30"})
    try:
        w.wait_for_log(r"connection refused; trying again")  # refused once: now the broker is back
        thread.start()
        w.wait_for_log(r"claimed ")
        assert w.terminate() == 0
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(5)
    assert "cannot reach Kafka" not in w.log


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
