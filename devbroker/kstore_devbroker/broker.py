"""Run a real Apache Kafka 4.x broker (KRaft) from the official jars, for tests and local use.

The jars come from Maven Central through ``mvn`` (no Kafka distribution or Docker needed) and
are cached outside the repository, in ``$KSTORE_CACHE_DIR`` or ``~/.cache/kstore``.

Every node runs with ``process.roles=broker,controller`` on 127.0.0.1; a cluster of ``n``
nodes is a static quorum of ``n`` voters. Test-friendly settings: replication factors of the
internal topics are ``min(3, n)``, ``group.initial.rebalance.delay.ms=0``,
``num.partitions=1``, small internal topics (5 partitions instead of 50) so that the first
consumer group or transaction does not wait for 150 replicas to be created, and a 4 s broker
session (instead of 9 s) so a killed node is fenced, and a restarted one admitted, sooner. Topic
auto-creation keeps Kafka's default (enabled) so the broker behaves like a stock one; pass
``extra_config={"auto.create.topics.enable": "false"}`` for tests that must see a missing
topic as an error.

Library use::

    with Cluster(n_brokers=3) as cluster:
        producer = Producer({"bootstrap.servers": cluster.bootstrap_servers})
        cluster.stop_node(0)   # fault injection; start_node(0) restarts it on the same port

Command line::

    python -m kstore_devbroker fetch
    python -m kstore_devbroker start [--brokers 3] [--state-file PATH]   # detached
    python -m kstore_devbroker stop [--state-file PATH]
    python -m kstore_devbroker run [--brokers 3]                          # foreground, Ctrl-C
    python -m kstore_devbroker start --secured      # TLS/SASL listeners; prints SecuredEndpoints as JSON
    python -m kstore_devbroker fetch-registry | run-registry   # a schema registry (kstore_devbroker.registry)

:class:`SecuredBroker` adds TLS and SASL listeners to one node, with throwaway certificates
(:mod:`kstore_devbroker.certs`) and users, for testing clients' security settings.

A JVM started by a :class:`Cluster` (not detached) never outlives the Python process: it runs
in its own process group, an ``atexit`` hook stops it, and a small watchdog process stops it
when the Python process dies without running ``atexit`` (SIGKILL, ``os._exit``).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from xml.sax.saxutils import quoteattr

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kstore_devbroker.certs import CertificateAuthority, KeyPair, encrypt_key

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_VERSION",
    "Broker",
    "Cluster",
    "ClusterState",
    "DevBrokerError",
    "Node",
    "NodeState",
    "SCRAM_MECHANISM",
    "SecuredBroker",
    "SecuredEndpoints",
    "WRONG_HOSTNAME",
    "cache_root",
    "fetch_jars",
    "java_executable",
    "main",
    "stop_detached",
]

DEFAULT_VERSION = "4.4.0"
KAFKA_GROUP = "org.apache.kafka"
KAFKA_ARTIFACT = "kafka_2.13"
HOST = "127.0.0.1"
DEFAULT_HEAP = "512m"
# C1 only (TieredStopAtLevel=1): a broker starts in ~3 s instead of ~5.5 s on 2 cores, and a
# 3-node cluster in ~6 s instead of ~11 s; steady-state speed is lower, which test loads do
# not notice. Pass jvm_options=() for the JVM's defaults.
DEFAULT_JVM_OPTIONS = (
    "-XX:+UseG1GC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
DEFAULT_START_TIMEOUT = 90.0
DEFAULT_STOP_TIMEOUT = 20.0
DEFAULT_STATE_FILE = Path(".kstore-dev") / "broker.json"

_MARKER = ".complete"
_FALLBACK_LOG4J = "2.24.3"
_MVN_TIMEOUT = 1800.0
_POLL = 0.1
_LOG_TAIL_LINES = 40


class DevBrokerError(RuntimeError):
    """The jars could not be fetched, or a broker did not start or stop as expected."""


# --------------------------------------------------------------------------------------------
# Jars
# --------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where jars are cached: ``$KSTORE_CACHE_DIR`` or ``~/.cache/kstore``."""
    env = os.environ.get("KSTORE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kstore"


def fetch_jars(version: str = DEFAULT_VERSION) -> Path:
    """Download ``kafka_2.13:<version>`` and its runtime dependencies; return the libs folder.

    The folder is complete only when the marker file exists: it is written last, so an
    interrupted download is redone from scratch on the next call. A file lock keeps parallel
    test workers from downloading into the same folder at once.
    """
    home = cache_root() / f"kafka-{version}"
    libs = home / "libs"
    if _cache_complete(home):
        return libs
    home.mkdir(parents=True, exist_ok=True)
    with _file_lock(home / ".lock"):
        if _cache_complete(home):
            return libs
        shutil.rmtree(libs, ignore_errors=True)
        _copy_dependencies(home, version, extra=_tools_jars(version))
        # kafka_2.13 depends on slf4j-api (and from 4.1 on log4j-core) but not on the binding
        # between them, which the distribution adds: without it the broker logs nothing.
        _copy_dependencies(home, version, extra=[*_tools_jars(version), *_logging_jars(libs)])
        jars = _check_libs(libs, version)
        marker = {"version": version, "jars": jars}
        (home / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return libs


def _tools_jars(version: str) -> list[tuple[str, str, str]]:
    """Kafka's command-line tools (``kafka-consumer-groups.sh``'s ConsumerGroupCommand and the rest),
    as the distribution ships them beside the broker."""
    return [(KAFKA_GROUP, "kafka-tools", version)]


def run_tool(main_class: str, *args: str, version: str = DEFAULT_VERSION,
             timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one of Kafka's own command-line tools from the cached jars, e.g.
    ``run_tool("org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server", ...)``."""
    libs = fetch_jars(version)
    return subprocess.run([java_executable(), "-Xmx256m", "-cp", f"{libs}/*", main_class, *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def _cache_complete(home: Path) -> bool:
    marker = home / _MARKER
    if not marker.is_file():
        return False
    try:
        found = json.loads(marker.read_text())
        jars, version = found["jars"], found["version"]
    except (ValueError, KeyError, TypeError):
        return False
    # A cache made before the tools were added lacks them: fetched again.
    return f"kafka-tools-{version}.jar" in jars and all((home / "libs" / name).is_file() for name in jars)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pom(version: str, extra: Sequence[tuple[str, str, str]]) -> str:
    deps = [(KAFKA_GROUP, KAFKA_ARTIFACT, version), *extra]
    body = "".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version></dependency>\n"
        for g, a, v in deps
    )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0">\n'
        "  <modelVersion>4.0.0</modelVersion>\n"
        "  <groupId>kstore.devbroker</groupId>\n"
        f"  <artifactId>kafka-{version}-jars</artifactId>\n"
        "  <version>1</version>\n"
        "  <packaging>pom</packaging>\n"
        f"  <dependencies>\n{body}  </dependencies>\n"
        "</project>\n"
    )


def _copy_dependencies(home: Path, version: str, extra: Sequence[tuple[str, str, str]]) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise DevBrokerError("Maven ('mvn') is not on PATH; it is needed to fetch the Kafka jars")
    (home / "pom.xml").write_text(_pom(version, extra))
    cmd = [
        mvn,
        "-q",
        "-B",
        "-Dstyle.color=never",
        "dependency:copy-dependencies",
        "-DoutputDirectory=libs",
        "-DincludeScope=runtime",
    ]
    try:
        done = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=_MVN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DevBrokerError(f"mvn did not finish in {_MVN_TIMEOUT:.0f} s in {home}") from exc
    if done.returncode != 0:
        output = _tail_text(done.stdout + done.stderr, _LOG_TAIL_LINES)
        raise DevBrokerError(f"mvn failed (exit {done.returncode}) in {home}:\n{output}")


def _jar_version(libs: Path, artifact: str) -> str | None:
    pattern = re.compile(rf"{re.escape(artifact)}-(\d[^/]*)\.jar")
    for jar in libs.glob(f"{artifact}-*.jar"):
        match = pattern.fullmatch(jar.name)
        if match:
            return match.group(1)
    return None


def _logging_jars(libs: Path) -> list[tuple[str, str, str]]:
    """log4j2 and the slf4j binding, in the versions Kafka pulled in where it did."""
    slf4j = _jar_version(libs, "slf4j-api")
    if slf4j is None:
        raise DevBrokerError(f"expected an slf4j-api jar in {libs}")
    # Kafka 4.0's pom has no log4j at all; its distribution shipped log4j 2.24.3.
    log4j = _jar_version(libs, "log4j-core") or _FALLBACK_LOG4J
    # slf4j 2 finds bindings through ServiceLoader and needs the "slf4j2" artifact.
    binding = "log4j-slf4j2-impl" if slf4j.startswith("2.") else "log4j-slf4j-impl"
    group = "org.apache.logging.log4j"
    return [(group, name, log4j) for name in ("log4j-api", "log4j-core", binding)]


def _check_libs(libs: Path, version: str) -> list[str]:
    jars = sorted(p.name for p in libs.glob("*.jar"))
    wanted = [f"{KAFKA_ARTIFACT}-{version}.jar", f"kafka-clients-{version}.jar", f"kafka-tools-{version}.jar"]
    missing = [name for name in wanted if name not in jars]
    if not any(name.startswith("log4j-slf4j") for name in jars):
        missing.append("log4j-slf4j*-impl")
    if missing:
        raise DevBrokerError(f"incomplete Kafka jars in {libs}: missing {missing}")
    return jars


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def java_executable() -> str:
    """``$JAVA_HOME/bin/java`` if it exists, else ``java`` on PATH (Kafka 4 needs Java 17+)."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise DevBrokerError("no Java found: set JAVA_HOME or put 'java' (17+) on PATH")
    return found


#: Starts of a cluster before a port taken by another process is reported (see Cluster.start).
PORT_ATTEMPTS = 3


class _PortTaken(DevBrokerError):
    """A node could not bind a port picked for it: another process took it first."""


def _bind_failed(node: Node) -> bool:
    """Whether ``node``'s log says a port it was given is in use."""
    try:
        return "Address already in use" in node.log_file.read_text(errors="replace")
    except OSError:
        return False


def _free_ports(count: int) -> list[int]:
    # All sockets stay open until every port is picked, so the same port is never handed out
    # twice. Another process can still grab one before the broker binds it: Cluster.start then
    # starts again on other ports.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def _new_cluster_id() -> str:
    # Kafka's Uuid.randomUuid(): 16 random bytes, URL-safe base64 without padding, never
    # starting with '-' (it would read as a command-line option). Doing it here saves a JVM.
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _formatted_cluster_id(data_dir: Path) -> str | None:
    for meta in sorted(data_dir.glob("node-*/data/meta.properties")):
        for line in meta.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "cluster.id":
                return value.strip()
    return None


def _tail_text(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _tail_file(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            return _tail_text(handle.read().decode("utf-8", "replace"), lines)
    except OSError:
        return f"(no {path.name})"


def _log4j_config(log_file: Path) -> str:
    # XML rather than Kafka's own log4j2.yaml: log4j-core parses XML with the JDK alone, while
    # YAML needs jackson-dataformat-yaml on the classpath. shutdownHook="disable": log4j's own
    # hook would otherwise close the file while Kafka's shutdown hook is still logging, and the
    # log would end before "shut down completed". Nothing is buffered (immediateFlush).
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<Configuration status="warn" shutdownHook="disable">\n'
        "  <Appenders>\n"
        f'    <File name="file" fileName={quoteattr(str(log_file))} append="true">\n'
        '      <PatternLayout pattern="[%d] %p %m (%c)%n"/>\n'
        "    </File>\n"
        "  </Appenders>\n"
        "  <Loggers>\n"
        '    <Root level="INFO"><AppenderRef ref="file"/></Root>\n'
        "  </Loggers>\n"
        "</Configuration>\n"
    )


# The watchdog is a separate tiny Python process holding the read end of a pipe whose write end
# only the owning Python process has. EOF on that pipe means the owner is gone (even by
# SIGKILL, which skips atexit), so the watchdog stops the JVM's process group.
_WATCHDOG = """
import os, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
sys.stdin.buffer.read()
def alive():
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
if alive():
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive():
        os.killpg(pgid, signal.SIGKILL)
"""


def _start_watchdog(pgid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(pgid), str(DEFAULT_STOP_TIMEOUT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a signal sent to the owner's process group must not kill it too.
        start_new_session=True,
    )


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


# --------------------------------------------------------------------------------------------
# Nodes and clusters
# --------------------------------------------------------------------------------------------


@dataclass
class Node:
    """One KRaft node (broker and controller) of a :class:`Cluster`."""

    node_id: int
    port: int
    controller_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    watchdog: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    #: Ports of listeners besides PLAINTEXT and CONTROLLER, by listener name (SecuredBroker).
    extra_ports: dict[str, int] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def log_file(self) -> Path:
        """The broker's log4j log."""
        return self.directory / "broker.log"

    @property
    def console_file(self) -> Path:
        """The JVM's stdout and stderr (crashes before log4j starts end up here)."""
        return self.directory / "console.log"

    @property
    def properties_file(self) -> Path:
        return self.directory / "server.properties"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def failure_report(self) -> str:
        return (
            f"--- tail of {self.log_file} ---\n{_tail_file(self.log_file)}\n"
            f"--- tail of {self.console_file} ---\n{_tail_file(self.console_file)}"
        )


@dataclass
class NodeState:
    node_id: int
    pid: int | None
    port: int
    controller_port: int
    directory: str


@dataclass
class ClusterState:
    """What ``start`` writes to the state file, and ``stop`` reads back."""

    version: str
    cluster_id: str
    bootstrap_servers: str
    data_dir: str
    owns_data_dir: bool
    nodes: list[NodeState]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        raw = json.loads(text)
        raw["nodes"] = [NodeState(**node) for node in raw["nodes"]]
        return cls(**raw)


_LIVE: set[Cluster] = set()
_C = TypeVar("_C", bound="Cluster")


@atexit.register
def _stop_live_clusters() -> None:
    for cluster in list(_LIVE):
        with contextlib.suppress(Exception):
            cluster.stop()


class Cluster:
    """``n_brokers`` KRaft nodes, each broker+controller, on free ports of 127.0.0.1.

    ``data_dir`` defaults to a fresh temporary folder that :meth:`stop` deletes; a given
    ``data_dir`` is kept. ``detach=True`` (used by the ``start`` command) lets the JVMs
    outlive this Python process: no atexit hook and no watchdog. Not thread-safe.
    """

    def __init__(
        self,
        n_brokers: int = 1,
        *,
        version: str = DEFAULT_VERSION,
        data_dir: str | os.PathLike[str] | None = None,
        heap: str = DEFAULT_HEAP,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
        extra_config: Mapping[str, str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        detach: bool = False,
    ) -> None:
        if n_brokers < 1:
            raise ValueError("n_brokers must be at least 1")
        self.n_brokers = n_brokers
        self.version = version
        self.heap = heap
        self.jvm_options = list(jvm_options)
        self.extra_config = dict(extra_config or {})
        self.start_timeout = start_timeout
        self.detach = detach
        self.cluster_id = _new_cluster_id()
        self._owns_data_dir = data_dir is None
        self._data_dir = None if data_dir is None else Path(data_dir)
        self._libs: Path | None = None
        self.nodes: list[Node] = []

    # -- public API ---------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:PORT[,...]`` for every node, running or not."""
        if not self.nodes:
            raise DevBrokerError("the cluster has not been started")
        return ",".join(node.address for node in self.nodes)

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise DevBrokerError("the cluster has not been started")
        return self._data_dir

    def start(self: _C) -> _C:
        """Fetch jars if needed, format storage, start every node and wait until all serve.

        The ports are picked free but released before Kafka binds them (it takes them from its
        configuration), so another process may take one first: a node that then fails to bind
        is started again on other ports, up to :data:`PORT_ATTEMPTS` times in all."""
        if self.nodes:
            raise DevBrokerError("the cluster was already started")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once()
            except _PortTaken:
                if attempt == PORT_ATTEMPTS:
                    raise
                log.warning("a port picked for Kafka was taken before it could bind it: starting again on others")
                self.nodes = []
        raise AssertionError("unreachable")

    def _start_once(self: _C) -> _C:
        self._libs = fetch_jars(self.version)
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="kstore-kafka-"))
        self._data_dir.mkdir(parents=True, exist_ok=True)
        # A kept data dir is reused (new ports, same data): its nodes are not formatted again,
        # so they keep the cluster id they were formatted with.
        self.cluster_id = _formatted_cluster_id(self._data_dir) or self.cluster_id
        self.nodes = self._plan_nodes()
        if not self.detach:
            _LIVE.add(self)
        try:
            self._format_all()
            for node in self.nodes:
                self._launch(node)
            self._wait_ready(self.nodes)
        except BaseException as exc:
            taken = isinstance(exc, DevBrokerError) and any(_bind_failed(node) for node in self.nodes)
            self.stop()  # deletes a temporary data dir, logs included: read them first
            if taken:
                raise _PortTaken(str(exc)) from exc
            raise
        return self

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """Stop every node (SIGTERM, then SIGKILL after ``timeout``); delete a temp data dir."""
        deadline = time.monotonic() + timeout
        running = [node for node in self.nodes if node.process is not None]
        # All at once, so every broker's controlled shutdown finishes while the controller
        # quorum still stands (one by one, the last broker would wait for a controller that
        # can no longer be elected). The Raft leader then waits 5 s (hard-coded in Kafka) for
        # voters that are gone to acknowledge its resignation: a 3-node stop takes ~6 s.
        self._terminate(running, deadline)
        _LIVE.discard(self)
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def stop_node(self, index: int, *, kill: bool = False, timeout: float = 30.0) -> None:
        """Stop node ``index`` (0-based), keeping its data. ``kill=True`` sends SIGKILL at once,
        like a crash; otherwise SIGTERM lets it shut down cleanly (SIGKILL after ``timeout``)."""
        node = self.nodes[index]
        if node.process is not None:
            self._terminate([node], time.monotonic() + timeout, kill=kill)

    def start_node(self, index: int) -> None:
        """Restart node ``index`` on the same ports with its data; wait until it serves."""
        node = self.nodes[index]
        if node.running:
            raise DevBrokerError(f"node {node.node_id} is already running")
        self._launch(node)
        try:
            self._wait_ready([node])
        except BaseException:
            self.stop_node(index, kill=True)
            raise

    def state(self) -> ClusterState:
        return ClusterState(
            version=self.version,
            cluster_id=self.cluster_id,
            bootstrap_servers=self.bootstrap_servers,
            data_dir=str(self.data_dir),
            owns_data_dir=self._owns_data_dir,
            nodes=[NodeState(n.node_id, n.pid, n.port, n.controller_port, str(n.directory)) for n in self.nodes],
        )

    def __enter__(self: _C) -> _C:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- configuration ------------------------------------------------------------------------

    def _extra_listeners(self) -> Sequence[str]:
        """Names of listeners a subclass adds to each node; each gets a port in ``Node.extra_ports``."""
        return ()

    def _format_options(self, node: Node) -> list[str]:
        """Extra ``kafka.tools.StorageTool format`` arguments (SCRAM users for SecuredBroker)."""
        return []

    def _plan_nodes(self) -> list[Node]:
        extra = list(self._extra_listeners())
        per_node = 2 + len(extra)
        ports = _free_ports(per_node * self.n_brokers)
        nodes = []
        for i in range(self.n_brokers):
            own = ports[per_node * i : per_node * (i + 1)]
            node = Node(i + 1, own[0], own[1], self.data_dir / f"node-{i + 1}")
            node.extra_ports = dict(zip(extra, own[2:], strict=True))
            nodes.append(node)
        voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in nodes)
        for node in nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            props = self._server_properties(node, voters)
            node.properties_file.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
            (node.directory / "log4j2.xml").write_text(_log4j_config(node.log_file))
        return nodes

    def _server_properties(self, node: Node, voters: str) -> dict[str, str]:
        replication = str(min(3, self.n_brokers))
        min_isr = str(min(2, self.n_brokers))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            # A static quorum (KIP-595 voters list): every node is formatted the same way,
            # with no --standalone / --initial-controllers as a dynamic quorum would need.
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{HOST}:{node.port},CONTROLLER://{HOST}:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{HOST}:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.directory / "data"),
            "num.partitions": "1",
            "default.replication.factor": replication,
            "offsets.topic.replication.factor": replication,
            "offsets.topic.num.partitions": "5",
            "transaction.state.log.replication.factor": replication,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": "5",
            "share.coordinator.state.topic.replication.factor": replication,
            "share.coordinator.state.topic.min.isr": min_isr,
            "group.initial.rebalance.delay.ms": "0",
            # A restarted node is refused (DUPLICATE_BROKER_REGISTRATION) until its previous
            # session expires, even after a clean stop; and a killed node keeps leading its
            # partitions until then. 4 s instead of 9 s, with heartbeats every 0.5 s.
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "500",
            "auto.create.topics.enable": "true",
        }
        props.update(self.extra_config)
        return props

    # -- processes ----------------------------------------------------------------------------

    def _java(self, node: Node, main_class: str, *args: str) -> list[str]:
        return [
            java_executable(),
            f"-Xmx{self.heap}",
            *self.jvm_options,
            f"-Dlog4j2.configurationFile={node.directory / 'log4j2.xml'}",
            "-cp",
            f"{self._libs}/*",  # expanded by java itself, not by a shell
            main_class,
            *args,
        ]

    def _format_all(self) -> None:
        # In parallel: each format is a JVM start of about 1.5 s.
        pending = []
        for node in self.nodes:
            if (node.directory / "data" / "meta.properties").exists():
                continue
            cmd = self._java(
                node,
                "kafka.tools.StorageTool",
                "format",
                "--cluster-id",
                self.cluster_id,
                "--config",
                str(node.properties_file),
                *self._format_options(node),
            )
            with node.console_file.open("ab") as out:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            pending.append((node, proc))
        for node, proc in pending:
            try:
                code = proc.wait(timeout=self.start_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0:
                raise DevBrokerError(f"formatting node {node.node_id} failed (exit {code})\n" + node.failure_report())

    def _launch(self, node: Node) -> None:
        self._disarm_watchdog(node)  # left over if the JVM died on its own
        cmd = self._java(node, "kafka.Kafka", str(node.properties_file))
        # Output goes to a file, never to our pipes: a caller reading our stdout (for example
        # `$(python -m kstore_devbroker start)`) would otherwise wait for the JVM to exit.
        with node.console_file.open("ab") as out:
            node.process = subprocess.Popen(
                cmd,
                cwd=node.directory,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Own session and process group: Ctrl-C in a terminal reaches only Python, which
                # then stops the nodes together; the detached CLI's JVMs survive the terminal;
                # and killpg reaches anything the JVM spawns.
                start_new_session=True,
            )
        if not self.detach:
            node.watchdog = _start_watchdog(node.process.pid)

    @staticmethod
    def _disarm_watchdog(node: Node) -> None:
        # Killed before the JVM is stopped, so it never signals a process group id that the
        # kernel may have handed to a new process by then.
        if node.watchdog is not None:
            node.watchdog.kill()
            node.watchdog.wait()
            if node.watchdog.stdin is not None:
                node.watchdog.stdin.close()
            node.watchdog = None

    def _terminate(self, nodes: Sequence[Node], deadline: float, *, kill: bool = False) -> None:
        # Without a majority of voters up there is no controller, and a broker's controlled
        # shutdown would wait for one until the deadline: nothing clean is left to do.
        kill = kill or 2 * sum(n.running for n in self.nodes) <= self.n_brokers
        for node in nodes:
            self._disarm_watchdog(node)
            if node.process is not None:
                _signal_group(node.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        for node in nodes:
            self._reap(node, deadline)

    @staticmethod
    def _reap(node: Node, deadline: float) -> None:
        proc = node.process
        if proc is None:
            return
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        node.process = None

    # -- readiness ----------------------------------------------------------------------------

    def _wait_ready(self, nodes: Sequence[Node]) -> None:
        deadline = time.monotonic() + self.start_timeout
        # Ports first: cheap, and spares the log the client's connection-refused warnings.
        for node in nodes:
            while not _port_open(node.port):
                self._check_progress(nodes, deadline, "open its port")
                time.sleep(_POLL)
        expected = {node.node_id for node in self.nodes if node.running}
        admin: AdminClient | None = None
        while True:
            admin, live = self._live_brokers(admin)
            if expected <= live:
                return
            self._check_progress(nodes, deadline, f"register brokers {sorted(expected)}")
            time.sleep(_POLL)

    def _live_brokers(self, admin: AdminClient | None) -> tuple[AdminClient, set[int]]:
        """Brokers that are registered and unfenced, i.e. caught up and serving (Kafka leaves fenced
        brokers out of its DescribeCluster answer)."""
        if admin is None:
            admin = AdminClient({
                "bootstrap.servers": ",".join(n.address for n in self.nodes if n.running),
                "client.id": "kstore-devbroker",
                "socket.timeout.ms": 5000,
                # librdkafka's lines (a connection refused while a node starts) stay out of the console.
                "logger": _QuietLog(),  # type: ignore[dict-item]
            })
        try:
            info = admin.describe_cluster(request_timeout=5).result(timeout=10)
        except (KafkaException, concurrent.futures.TimeoutError, OSError):
            return admin, set()
        return admin, {node.id for node in info.nodes}

    def _check_progress(self, nodes: Sequence[Node], deadline: float, what: str) -> None:
        for node in nodes:
            if node.process is not None and node.process.poll() is not None:
                raise DevBrokerError(
                    f"Kafka node {node.node_id} exited with code {node.process.returncode} "
                    f"before it could {what}\n" + node.failure_report()
                )
        if time.monotonic() > deadline:
            reports = "\n".join(n.failure_report() for n in nodes)
            raise DevBrokerError(f"Kafka did not {what} within {self.start_timeout:.0f} s\n{reports}")


class _QuietLog:
    """The ``logger`` of the readiness check's admin client: librdkafka's lines at DEBUG (it retries by itself)."""

    def log(self, _level: int, msg: str, *args: Any) -> None:
        log.debug(msg, *args)


class Broker(Cluster):
    """A single Kafka node (broker and controller): ``Cluster(n_brokers=1)``."""

    def __init__(
        self,
        *,
        version: str = DEFAULT_VERSION,
        data_dir: str | os.PathLike[str] | None = None,
        heap: str = DEFAULT_HEAP,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
        extra_config: Mapping[str, str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        detach: bool = False,
    ) -> None:
        super().__init__(
            1,
            version=version,
            data_dir=data_dir,
            heap=heap,
            jvm_options=jvm_options,
            extra_config=extra_config,
            start_timeout=start_timeout,
            detach=detach,
        )

    @property
    def port(self) -> int:
        return self.nodes[0].port


# --------------------------------------------------------------------------------------------
# A broker with secured listeners
# --------------------------------------------------------------------------------------------

_SASL_SSL, _SSL, _SASL_PLAINTEXT, _WRONG_HOST = "SASL_SSL", "SSL", "SASL_PLAINTEXT", "WRONG_HOST"
_SECURED_PROTOCOLS = {_SASL_SSL: "SASL_SSL", _SSL: "SSL", _SASL_PLAINTEXT: "SASL_PLAINTEXT", _WRONG_HOST: "SSL"}
#: The SCRAM mechanism of the SASL_SSL listener.
SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"
_PLAIN_MODULE = "org.apache.kafka.common.security.plain.PlainLoginModule"
_OAUTH_MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
#: The only name in the WRONG_HOST listener's certificate: a client that checks hostnames fails.
WRONG_HOSTNAME = "wrong.example.invalid"


@dataclass(frozen=True)
class SecuredEndpoints:
    """Where a :class:`SecuredBroker` listens, and the files and credentials its clients need.

    Every address is ``127.0.0.1:PORT``; every file is a PEM file in the broker's data folder.
    The broker's certificates (``IP:127.0.0.1``, ``DNS:localhost``) are signed by ``ca_file``.
    """

    #: No security; the test harness and inter-broker traffic use it.
    plaintext: str
    #: SASL SCRAM-SHA-512 over TLS (``scram_user``/``scram_password``); no client certificate.
    sasl_ssl: str
    #: Mutual TLS: a client certificate signed by ``ca_file`` is required.
    ssl: str
    #: SASL without TLS: PLAIN (``plain_user``/``plain_password``) and OAUTHBEARER (unsigned JWTs).
    sasl_plaintext: str
    #: TLS without client auth, whose certificate names only ``wrong.example.invalid``.
    wrong_hostname: str
    ca_file: str
    #: A CA that signed nothing the broker uses: a client trusting only it refuses the broker.
    other_ca_file: str
    #: Signed by ``ca_file``, for the mutual-TLS listener.
    client_cert_file: str
    client_key_file: str
    #: ``client_key_file`` encrypted (PKCS#8, AES-256) with ``client_key_password``.
    client_key_encrypted_file: str
    client_key_password: str
    #: Signed by ``ca_file`` but valid only in January 2020.
    expired_cert_file: str
    expired_key_file: str
    scram_user: str
    scram_password: str
    plain_user: str
    plain_password: str
    scram_mechanism: str = SCRAM_MECHANISM


@dataclass(frozen=True)
class _BrokerTls:
    keystore: Path
    wrong_host_keystore: Path
    ca: CertificateAuthority
    other_ca: CertificateAuthority
    client: KeyPair
    client_key_encrypted: Path
    expired: KeyPair


def _make_broker_tls(directory: Path, key_password: str) -> _BrokerTls:
    # ~30 ms in all with EC keys: cheaper than keeping them between runs.
    ca = CertificateAuthority.create(directory / "ca", "kstore-dev-ca")
    other_ca = CertificateAuthority.create(directory / "other-ca", "kstore-dev-other-ca")
    broker = ca.issue("broker", sans=(f"IP:{HOST}", "DNS:localhost"))
    wrong = ca.issue("broker-wrong-host", sans=(f"DNS:{WRONG_HOSTNAME}",))
    client = ca.issue("client")
    return _BrokerTls(
        keystore=broker.write_bundle(directory / "broker.keystore.pem", ca.cert),
        wrong_host_keystore=wrong.write_bundle(directory / "broker-wrong-host.keystore.pem", ca.cert),
        ca=ca,
        other_ca=other_ca,
        client=client,
        client_key_encrypted=encrypt_key(client.key, directory / "client.encrypted.key", key_password),
        expired=ca.issue("client-expired", expired=True),
    )


def _jaas(module: str, **options: str) -> str:
    return " ".join([module, "required", *(f'{k}="{v}"' for k, v in options.items())]) + ";"


class SecuredBroker(Broker):
    """One Kafka node with TLS and SASL listeners besides PLAINTEXT, for testing clients' security.

    Listeners (see :class:`SecuredEndpoints`, from :attr:`endpoints` once started): SASL_SSL
    with SCRAM-SHA-512, SSL with client certificates required, SASL_PLAINTEXT with PLAIN and
    OAUTHBEARER, and an SSL listener whose certificate is for a wrong hostname. A throwaway CA,
    a second unrelated CA and the certificates are made with ``openssl`` at start, in the data
    folder. The SCRAM user is created when the storage is formatted (``--add-scram``), so it
    exists before the broker serves.

    OAUTHBEARER uses Kafka's default *unsecured* validator: any unsigned JWT (``alg: none``)
    with a ``sub`` and an ``exp`` in the future is accepted (see ``unsecured_jwt`` in
    tests/integration/dev_broker/test_devbroker_secured.py).
    """

    def __init__(
        self,
        *,
        scram_user: str = "kstore-scram",
        scram_password: str = "scram-secret",
        plain_user: str = "kstore-plain",
        plain_password: str = "plain-secret",
        client_key_password: str = "client-key-secret",
        version: str = DEFAULT_VERSION,
        data_dir: str | os.PathLike[str] | None = None,
        heap: str = DEFAULT_HEAP,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
        extra_config: Mapping[str, str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        detach: bool = False,
    ) -> None:
        super().__init__(
            version=version,
            data_dir=data_dir,
            heap=heap,
            jvm_options=jvm_options,
            extra_config=extra_config,
            start_timeout=start_timeout,
            detach=detach,
        )
        self.scram_user = scram_user
        self.scram_password = scram_password
        self.plain_user = plain_user
        self.plain_password = plain_password
        self.client_key_password = client_key_password
        self._tls: _BrokerTls | None = None

    @property
    def endpoints(self) -> SecuredEndpoints:
        if self._tls is None or not self.nodes:
            raise DevBrokerError("the broker has not been started")
        tls, node = self._tls, self.nodes[0]
        return SecuredEndpoints(
            plaintext=node.address,
            sasl_ssl=f"{HOST}:{node.extra_ports[_SASL_SSL]}",
            ssl=f"{HOST}:{node.extra_ports[_SSL]}",
            sasl_plaintext=f"{HOST}:{node.extra_ports[_SASL_PLAINTEXT]}",
            wrong_hostname=f"{HOST}:{node.extra_ports[_WRONG_HOST]}",
            ca_file=str(tls.ca.cert),
            other_ca_file=str(tls.other_ca.cert),
            client_cert_file=str(tls.client.cert),
            client_key_file=str(tls.client.key),
            client_key_encrypted_file=str(tls.client_key_encrypted),
            client_key_password=self.client_key_password,
            expired_cert_file=str(tls.expired.cert),
            expired_key_file=str(tls.expired.key),
            scram_user=self.scram_user,
            scram_password=self.scram_password,
            plain_user=self.plain_user,
            plain_password=self.plain_password,
        )

    def _extra_listeners(self) -> Sequence[str]:
        return tuple(_SECURED_PROTOCOLS)

    def _plan_nodes(self) -> list[Node]:
        # Before the properties are written: they name the certificate files.
        self._tls = _make_broker_tls(self.data_dir / "tls", self.client_key_password)
        return super()._plan_nodes()

    def _format_options(self, node: Node) -> list[str]:
        return ["--add-scram", f"{SCRAM_MECHANISM}=[name={self.scram_user},password={self.scram_password}]"]

    def _server_properties(self, node: Node, voters: str) -> dict[str, str]:
        if self._tls is None:
            raise DevBrokerError("the TLS files are made before the properties")
        ports = {"PLAINTEXT": node.port, **node.extra_ports}
        served = ",".join(f"{name}://{HOST}:{port}" for name, port in ports.items())
        protocols = {"PLAINTEXT": "PLAINTEXT", "CONTROLLER": "PLAINTEXT", **_SECURED_PROTOCOLS}
        scram = SCRAM_MECHANISM.lower()
        props = super()._server_properties(node, voters)
        props.update(
            {
                "listeners": f"{served},CONTROLLER://{HOST}:{node.controller_port}",
                "advertised.listeners": served,
                "listener.security.protocol.map": ",".join(f"{k}:{v}" for k, v in protocols.items()),
                # PEM files, read by Kafka directly (no JKS or PKCS12 conversion). The key is
                # unencrypted, so no ssl.key.password (a PEM keystore takes no store password).
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": str(self._tls.keystore),
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": str(self._tls.ca.cert),
                # Per-listener settings override the global ssl.* ones for that listener only.
                f"listener.name.{_SSL.lower()}.ssl.client.auth": "required",
                f"listener.name.{_WRONG_HOST.lower()}.ssl.keystore.location": str(self._tls.wrong_host_keystore),
                f"listener.name.{_SASL_SSL.lower()}.sasl.enabled.mechanisms": SCRAM_MECHANISM,
                f"listener.name.{_SASL_SSL.lower()}.{scram}.sasl.jaas.config": _jaas(_SCRAM_MODULE),
                f"listener.name.{_SASL_PLAINTEXT.lower()}.sasl.enabled.mechanisms": "PLAIN,OAUTHBEARER",
                f"listener.name.{_SASL_PLAINTEXT.lower()}.plain.sasl.jaas.config": _jaas(
                    _PLAIN_MODULE, **{f"user_{self.plain_user}": self.plain_password}
                ),
                # The broker logs in too, with an unsecured token of its own; clients' tokens
                # are checked by the default unsecured validator (signature alg "none").
                f"listener.name.{_SASL_PLAINTEXT.lower()}.oauthbearer.sasl.jaas.config": _jaas(
                    _OAUTH_MODULE, unsecuredLoginStringClaim_sub="kstore-devbroker"
                ),
            }
        )
        props.update(self.extra_config)
        return props


# --------------------------------------------------------------------------------------------
# Detached clusters (state file)
# --------------------------------------------------------------------------------------------


def _is_our_jvm(pid: int, properties_file: str) -> bool:
    """The pid is still a live Kafka JVM for this node, not a process that reused the pid."""
    proc = Path("/proc") / str(pid)
    try:
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    # A zombie is dead; it lingers where PID 1 does not reap orphans (some containers).
    return state != "Z" and properties_file.encode() in cmdline and b"kafka.Kafka" in cmdline


def stop_detached(state: ClusterState, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
    """Stop the JVMs of a cluster started with ``detach=True`` in another process."""
    targets = [
        (node.pid, str(Path(node.directory) / "server.properties")) for node in state.nodes if node.pid is not None
    ]
    targets = [(pid, props) for pid, props in targets if _is_our_jvm(pid, props)]
    for pid, _ in targets:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_is_our_jvm(pid, props) for pid, props in targets):
        if time.monotonic() > deadline:
            for pid, props in targets:
                if _is_our_jvm(pid, props):
                    _signal_group(pid, signal.SIGKILL)
            break
        time.sleep(_POLL)
    if state.owns_data_dir:
        shutil.rmtree(state.data_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _cmd_fetch(args: argparse.Namespace) -> int:
    started = time.monotonic()
    libs = fetch_jars(args.version)
    print(f"{libs} ({time.monotonic() - started:.1f} s)")
    return 0


def _running_state(path: Path) -> ClusterState | None:
    if not path.is_file():
        return None
    state = ClusterState.from_json(path.read_text())
    alive = any(
        n.pid is not None and _is_our_jvm(n.pid, str(Path(n.directory) / "server.properties")) for n in state.nodes
    )
    return state if alive else None


def _write_state(path: Path, cluster: Cluster) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(cluster.state().to_json())
    tmp.replace(path)


def _new_cluster(args: argparse.Namespace, *, detach: bool) -> Cluster:
    if not args.secured:
        return Cluster(
            args.brokers, version=args.version, data_dir=args.data_dir, start_timeout=args.timeout, detach=detach
        )
    if args.brokers != 1:
        raise DevBrokerError("--secured starts a single broker; drop --brokers")
    return SecuredBroker(version=args.version, data_dir=args.data_dir, start_timeout=args.timeout, detach=detach)


def _print_started(cluster: Cluster) -> None:
    # A secured broker's addresses, files and credentials, as JSON (SecuredEndpoints' fields).
    if isinstance(cluster, SecuredBroker):
        print(json.dumps(asdict(cluster.endpoints), indent=2), flush=True)
    else:
        print(cluster.bootstrap_servers, flush=True)
        print(f"export KSTORE_BOOTSTRAP_SERVERS={cluster.bootstrap_servers}   # for kstore in this shell",
              file=sys.stderr, flush=True)


def _cmd_start(args: argparse.Namespace) -> int:
    state_file = Path(args.state_file)
    running = _running_state(state_file)
    if running is not None:
        print(f"already running ({state_file}): {running.bootstrap_servers}", file=sys.stderr)
        return 1
    cluster = _new_cluster(args, detach=True)
    cluster.start()
    _write_state(state_file, cluster)
    _print_started(cluster)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    state_file = Path(args.state_file)
    if not state_file.is_file():
        print(f"no state file {state_file}; nothing to stop", file=sys.stderr)
        return 0
    stop_detached(ClusterState.from_json(state_file.read_text()))
    state_file.unlink()
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _cmd_run(args: argparse.Namespace) -> int:
    state_file = Path(args.state_file)
    # SIGTERM (from a process manager) takes the same clean path as Ctrl-C. SIGINT is set
    # too because a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    cluster = _new_cluster(args, detach=False)
    try:
        with cluster:
            _write_state(state_file, cluster)
            _print_started(cluster)
            print("running; Ctrl-C to stop", file=sys.stderr, flush=True)
            while all(node.running for node in cluster.nodes):
                time.sleep(0.5)
            print("a Kafka node exited; stopping", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    finally:
        state_file.unlink(missing_ok=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kstore_devbroker", description="A real Kafka broker for development."
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kafka-version", dest="version", default=DEFAULT_VERSION, help=DEFAULT_VERSION)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", parents=[common], help="download the Kafka jars")
    fetch.set_defaults(func=_cmd_fetch)
    for name, func, text in (
        ("start", _cmd_start, "start in the background and print the bootstrap address"),
        ("run", _cmd_run, "run in the foreground until Ctrl-C"),
    ):
        cmd = sub.add_parser(name, parents=[common], help=text)
        cmd.add_argument("--brokers", type=int, default=1, help="number of nodes (default 1)")
        cmd.add_argument("--data-dir", default=None, help="kept after stop (default: temp)")
        cmd.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT)
        cmd.add_argument("--state-file", default=str(DEFAULT_STATE_FILE))
        cmd.add_argument(
            "--secured",
            action="store_true",
            help="one broker with SASL_SSL, SSL (mutual TLS), SASL_PLAINTEXT and wrong-hostname TLS listeners;"
            " prints their addresses, certificate files and users as JSON",
        )
        cmd.set_defaults(func=func)
    stop = sub.add_parser("stop", help="stop what 'start' started")
    stop.add_argument("--state-file", default=str(DEFAULT_STATE_FILE))
    stop.set_defaults(func=_cmd_stop)
    # Imported here: the registry module imports this one.
    from kstore_devbroker.registry import add_registry_commands

    add_registry_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except DevBrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
