"""Run a real schema registry with Confluent's API (Apicurio Registry 3), for tests and local use.

The server is Apicurio Registry's ready-built Quarkus application, fetched from Maven Central
through ``mvn`` (``io.apicurio:apicurio-registry-app:<version>:tar.gz:all``) and unpacked in
:func:`~kstore_devbroker.broker.cache_root`, like the Kafka jars. It needs Java 21 or newer
(:func:`find_java21`); Kafka's own default Java may be older.

Confluent's clients (confluent-kafka's ``SchemaRegistryClient``) talk to :attr:`DevRegistry.url`,
``http://127.0.0.1:PORT/apis/ccompat/v7``. Unlike Confluent's, its default compatibility level is
``NONE``: set it with ``PUT /config`` where a test relies on another one.

Schemas are kept in an H2 database file in the data folder, written on every commit, so
:meth:`DevRegistry.stop` then :meth:`DevRegistry.start` brings the same registry back on the same
ports with the same schema ids (even after ``stop(kill=True)``), for outage tests::

    with DevRegistry() as registry:
        client = SchemaRegistryClient({"url": registry.url})
        registry.stop()    # the registry is down: requests fail
        registry.start()   # back, with every schema it had

Command line::

    python -m kstore_devbroker fetch-registry
    python -m kstore_devbroker run-registry [--port 8081] [--data-dir DIR | --temp]   # foreground, Ctrl-C

``run-registry`` keeps its schemas in :data:`DEFAULT_DATA_DIR` (``.kstore-dev/registry`` in the folder
it runs in, beside the broker's state file) unless given ``--data-dir``, so a registry stopped and run
again still has the schemas (and ids) the records on the topics name; ``--temp`` gives it a throwaway
folder instead, deleted when it stops. (:class:`DevRegistry` itself defaults to a throwaway folder:
tests want a registry of their own each.)

Like a :class:`~kstore_devbroker.broker.Cluster`'s, the JVM never outlives the Python process
(its own process group, an ``atexit`` hook, and a watchdog process).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from kstore_devbroker.broker import (
    _MVN_TIMEOUT,
    DEFAULT_JVM_OPTIONS,
    DEFAULT_STATE_FILE,
    HOST,
    PORT_ATTEMPTS,
    DevBrokerError,
    _file_lock,
    _free_ports,
    _raise_interrupt,
    _signal_group,
    _start_watchdog,
    _tail_file,
    _tail_text,
    cache_root,
)

log = logging.getLogger(__name__)

__all__ = [
    "CCOMPAT_PATH",
    "DEFAULT_DATA_DIR",
    "MIN_JAVA",
    "REGISTRY_VERSION",
    "DevRegistry",
    "fetch_registry",
    "find_java21",
    "registry_artifact",
]

REGISTRY_VERSION = "3.3.3"
REGISTRY_GROUP = "io.apicurio"
REGISTRY_ARTIFACT = "apicurio-registry-app"
#: Apicurio Registry 3.3 is built for Java 21.
MIN_JAVA = 21
#: Confluent's REST API (v7) under the registry's base URL.
CCOMPAT_PATH = "/apis/ccompat/v7"
DEFAULT_REGISTRY_HEAP = "256m"
DEFAULT_REGISTRY_START_TIMEOUT = 90.0
DEFAULT_REGISTRY_STOP_TIMEOUT = 20.0
#: Where ``run-registry`` keeps its schemas by default (relative to the folder it runs in): kept across
#: restarts, because a registry that comes back empty makes every record on the topics name an unknown id.
DEFAULT_DATA_DIR = DEFAULT_STATE_FILE.parent / "registry"

_MARKER = ".complete"
_POLL = 0.1
_LOG_TAIL_LINES = 40
_PORT_IN_USE = "seems to be in use by another process"  # Quarkus's words when it cannot bind
# Requests to 127.0.0.1 never go through a proxy named in the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --------------------------------------------------------------------------------------------
# The server and Java
# --------------------------------------------------------------------------------------------


def registry_artifact(version: str = REGISTRY_VERSION) -> str:
    """The Maven coordinates of the server: ``io.apicurio:apicurio-registry-app:<version>:tar.gz:all``."""
    return f"{REGISTRY_GROUP}:{REGISTRY_ARTIFACT}:{version}:tar.gz:all"


def fetch_registry(version: str = REGISTRY_VERSION) -> Path:
    """Download and unpack Apicurio Registry ``version``; return the folder of ``quarkus-run.jar``.

    Cached in ``cache_root()/apicurio-registry-<version>``, complete once its marker file is
    written (last): an interrupted fetch is redone from scratch. A file lock keeps parallel test
    workers from fetching into the same folder at once.
    """
    home = cache_root() / f"apicurio-registry-{version}"
    app = home / "app"
    if _registry_complete(home, version):
        return app
    home.mkdir(parents=True, exist_ok=True)
    with _file_lock(home / ".lock"):
        if _registry_complete(home, version):
            return app
        download = home / "download"
        for folder in (app, download):
            shutil.rmtree(folder, ignore_errors=True)
        _mvn_copy(registry_artifact(version), download)
        tarball = download / f"{REGISTRY_ARTIFACT}-{version}-all.tar.gz"
        if not tarball.is_file():
            raise DevBrokerError(f"mvn did not leave {tarball.name} in {download}")
        app.mkdir()
        _run(["tar", "xzf", str(tarball), "-C", str(app)], cwd=home, what="unpacking the registry")
        if not (app / "quarkus-run.jar").is_file():
            raise DevBrokerError(f"no quarkus-run.jar in {tarball.name}")
        shutil.rmtree(download)  # Maven keeps its own copy in its local repository
        marker = {"version": version, "artifact": registry_artifact(version)}
        (home / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return app


def _registry_complete(home: Path, version: str) -> bool:
    try:
        found = json.loads((home / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and found.get("version") == version and (home / "app" / "quarkus-run.jar").is_file()


def _mvn_copy(artifact: str, output: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise DevBrokerError("Maven ('mvn') is not on PATH; it is needed to fetch the schema registry")
    output.mkdir(parents=True)
    cmd = [mvn, "-q", "-B", "-Dstyle.color=never", "dependency:copy", f"-Dartifact={artifact}",
           f"-DoutputDirectory={output}"]
    _run(cmd, cwd=output, what="mvn")


def _run(cmd: Sequence[str], *, cwd: Path, what: str) -> None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_MVN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DevBrokerError(f"{what} did not finish in {_MVN_TIMEOUT:.0f} s in {cwd}") from exc
    if done.returncode != 0:
        output = _tail_text(done.stdout + done.stderr, _LOG_TAIL_LINES)
        raise DevBrokerError(f"{what} failed (exit {done.returncode}) in {cwd}:\n{output}")


def java_major(java: str | os.PathLike[str]) -> int | None:
    """The major version of a ``java`` executable (``8`` for 1.8), or None if it does not say.

    Read from the ``release`` file of its Java home when there is one (no JVM started)."""
    path = Path(java).resolve()
    try:
        release = (path.parent.parent / "release").read_text()
        match = re.search(r'^JAVA_VERSION="([^"]+)"', release, re.MULTILINE)
    except OSError:
        match = None
    if match is None:
        try:
            done = subprocess.run([str(path), "-version"], capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        match = re.search(r'version "([^"]+)"', done.stderr + done.stdout)
        if match is None:
            return None
    numbers = [int(n) for n in re.findall(r"\d+", match.group(1))[:2]]
    if not numbers:
        return None
    return numbers[1] if numbers[0] == 1 and len(numbers) > 1 else numbers[0]


def find_java21(minimum: int = MIN_JAVA) -> str:
    """A ``java`` of version ``minimum`` (21) or newer: ``$JAVA_HOME/bin/java``, else ``java`` on
    PATH, else the newest under ``/usr/lib/jvm``."""
    first: list[Path] = []
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        first.append(Path(java_home) / "bin" / "java")
    on_path = shutil.which("java")
    if on_path:
        first.append(Path(on_path))
    for java in first:
        if _is_executable(java) and (java_major(java) or 0) >= minimum:
            return str(java)
    installed = [(java_major(java) or 0, java) for java in sorted(Path("/usr/lib/jvm").glob("*/bin/java"))
                 if _is_executable(java)]
    newest = max(installed, default=None, key=lambda found: found[0])
    if newest is not None and newest[0] >= minimum:
        return str(newest[1])
    raise DevBrokerError(
        f"the schema registry needs Java {minimum} or newer, and none was found (JAVA_HOME, java on PATH,"
        f" /usr/lib/jvm/*): install openjdk-{minimum}-jre-headless (apt-get install openjdk-{minimum}-jre-headless)"
        f" or another JDK {minimum}+, or point JAVA_HOME at one"
    )


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------


_LIVE: set[DevRegistry] = set()
_R = TypeVar("_R", bound="DevRegistry")


@atexit.register
def _close_live_registries() -> None:
    for registry in list(_LIVE):
        with contextlib.suppress(Exception):
            registry.close()


class DevRegistry:
    """One Apicurio Registry server on 127.0.0.1, its schemas in an H2 file in ``data_dir``.

    ``port`` (the API) and ``management_port`` (health) are picked free at the first
    :meth:`start` unless given, then kept: :meth:`stop` and :meth:`start` again bring the same
    registry back at the same :attr:`url`. ``data_dir`` defaults to a temporary folder that
    :meth:`close` (and leaving a ``with`` block) deletes; a given one is kept. ``extra_config``
    adds or overrides ``-D`` properties of the server. Not thread-safe.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        management_port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        version: str = REGISTRY_VERSION,
        heap: str = DEFAULT_REGISTRY_HEAP,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
        extra_config: Mapping[str, str] | None = None,
        start_timeout: float = DEFAULT_REGISTRY_START_TIMEOUT,
    ) -> None:
        self.port = port
        self.management_port = management_port
        self._given_ports = (port, management_port)
        self.version = version
        self.heap = heap
        self.jvm_options = list(jvm_options)
        self.extra_config = dict(extra_config or {})
        self.start_timeout = start_timeout
        self._owns_data_dir = data_dir is None
        # Absolute: the server runs in it, and its JDBC URL names a path in it.
        self._data_dir = None if data_dir is None else Path(data_dir).absolute()
        self.process: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- public API ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Confluent's API: ``http://127.0.0.1:PORT/apis/ccompat/v7`` (a ``SchemaRegistryClient``'s ``url``)."""
        if self.port is None:
            raise DevBrokerError("the registry has not been started")
        return f"http://{HOST}:{self.port}{CCOMPAT_PATH}"

    @property
    def health_url(self) -> str:
        """Readiness: 200 once the server serves, with its storage."""
        if self.management_port is None:
            raise DevBrokerError("the registry has not been started")
        return f"http://{HOST}:{self.management_port}/health/ready"

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise DevBrokerError("the registry has not been started")
        return self._data_dir

    @property
    def database(self) -> Path:
        """The H2 database, without H2's ``.mv.db`` suffix."""
        return self.data_dir / "db" / "registry"

    @property
    def log_file(self) -> Path:
        """The server's output (Quarkus logs to the console), appended to at every start."""
        return self.data_dir / "registry.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self: _R) -> _R:
        """Fetch the server if needed, start it and wait until it serves.

        Picked ports are released before the server binds them, so another process may take
        one first: the first start then tries other ports, up to ``PORT_ATTEMPTS`` times in
        all. A later start (a restart) uses the ports of the first and fails if they are taken.
        """
        if self.running:
            raise DevBrokerError("the registry is already running")
        app = fetch_registry(self.version)
        java = find_java21()
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="kstore-registry-"))
        if ";" in str(self.data_dir):
            raise DevBrokerError(f"the data folder's path must not contain ';' (a JDBC URL holds it): {self.data_dir}")
        self.database.parent.mkdir(parents=True, exist_ok=True)
        first_start = self.port is None or self.management_port is None
        attempts = PORT_ATTEMPTS if first_start else 1
        for attempt in range(1, attempts + 1):
            if first_start:
                self._pick_ports()
            self._launch(java, app)
            try:
                self._wait_ready()
                return self
            except BaseException as exc:
                taken = isinstance(exc, DevBrokerError) and _PORT_IN_USE in self._this_log()
                self.stop(kill=True)
                if not (taken and attempt < attempts):
                    if first_start:
                        self.port, self.management_port = self._given_ports
                    raise
                log.warning("a port picked for the registry was taken before it bound it: starting again on others")
        raise AssertionError("unreachable")

    def stop(self, *, kill: bool = False, timeout: float = DEFAULT_REGISTRY_STOP_TIMEOUT) -> None:
        """Stop the server, keeping its ports and data for :meth:`start`. SIGTERM lets it shut down
        cleanly (SIGKILL after ``timeout``); ``kill=True`` sends SIGKILL at once, like a crash."""
        self._disarm_watchdog()
        proc = self.process
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            self.process = None
        _LIVE.discard(self)

    def close(self) -> None:
        """:meth:`stop`, and delete the data folder if it is a temporary one."""
        self.stop()
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self: _R) -> _R:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- process ------------------------------------------------------------------------------

    def _pick_ports(self) -> None:
        port, management_port = self._given_ports
        free = iter(_free_ports(2))
        self.port = port if port is not None else next(free)
        self.management_port = management_port if management_port is not None else next(free)

    def _command(self, java: str, app: Path) -> list[str]:
        props = {
            "quarkus.http.host": HOST,
            "quarkus.http.port": str(self.port),
            # Health and metrics: on 0.0.0.0:9000 unless told otherwise.
            "quarkus.management.host": HOST,
            "quarkus.management.port": str(self.management_port),
            "quarkus.http.access-log.enabled": "false",
            # Apicurio's default storage is SQL on an in-memory H2 database; a file instead keeps the
            # schemas (and their ids) across a restart. WRITE_DELAY=0: every commit reaches the
            # file at once, so a killed server loses nothing it acknowledged (H2 otherwise writes
            # up to 0.5 s later, and a restarted registry hands out the lost ids again).
            "apicurio.storage.kind": "sql",
            "apicurio.storage.sql.kind": "h2",
            "apicurio.datasource.url": f"jdbc:h2:file:{self.database};WRITE_DELAY=0",
            # 20 connections opened at start by default: a test registry needs few.
            "apicurio.datasource.jdbc.initial-size": "2",
            "apicurio.datasource.jdbc.min-size": "2",
            "apicurio.datasource.jdbc.max-size": "20",
            **self.extra_config,
        }
        return [
            java,
            f"-Xmx{self.heap}",
            *self.jvm_options,
            *(f"-D{key}={value}" for key, value in props.items()),
            "-jar",
            str(app / "quarkus-run.jar"),
        ]

    def _launch(self, java: str, app: Path) -> None:
        cmd = self._command(java, app)
        with self.log_file.open("ab") as out:
            self._log_offset = out.tell()
            # Own session and process group, output to a file (see Cluster._launch).
            self.process = subprocess.Popen(
                cmd,
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)
        self._watchdog = _start_watchdog(self.process.pid)

    def _disarm_watchdog(self) -> None:
        # Before the JVM is stopped, so it never signals a process group id handed out again.
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            if self._watchdog.stdin is not None:
                self._watchdog.stdin.close()
            self._watchdog = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        # Ready (storage included), then Confluent's API itself answering.
        for probe in (self.health_url, f"{self.url}/config"):
            while not _answers(probe):
                proc = self.process
                if proc is not None and proc.poll() is not None:
                    raise DevBrokerError(
                        f"the schema registry exited with code {proc.returncode} before it served\n"
                        + self._failure_report()
                    )
                if time.monotonic() > deadline:
                    within = f"within {self.start_timeout:.0f} s"
                    raise DevBrokerError(f"the schema registry did not serve {within}\n" + self._failure_report())
                time.sleep(_POLL)

    def _this_log(self) -> str:
        """What the server wrote since its last start."""
        try:
            with self.log_file.open("rb") as handle:
                handle.seek(self._log_offset)
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _failure_report(self) -> str:
        return f"--- tail of {self.log_file} ---\n{_tail_file(self.log_file, _LOG_TAIL_LINES)}"


def _answers(url: str) -> bool:
    try:
        with _HTTP.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException):  # urllib's errors, 503 included, are OSErrors
        return False


# --------------------------------------------------------------------------------------------
# Command line (python -m kstore_devbroker ...)
# --------------------------------------------------------------------------------------------


def _cmd_fetch_registry(args: argparse.Namespace) -> int:
    started = time.monotonic()
    app = fetch_registry(args.registry_version)
    print(f"{app} ({time.monotonic() - started:.1f} s)")
    return 0


def _cmd_run_registry(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    if args.temp and args.data_dir is not None:
        print("--temp and --data-dir: give one or the other", file=sys.stderr)
        return 2
    data_dir = None if args.temp else (args.data_dir or DEFAULT_DATA_DIR)
    registry = DevRegistry(port=args.port, data_dir=data_dir, version=args.registry_version, start_timeout=args.timeout)
    try:
        with registry:
            print(registry.url, flush=True)
            kept = "deleted when it stops (--temp)" if args.temp else "kept across restarts"
            print(f"schemas in {registry.data_dir}, {kept}", file=sys.stderr, flush=True)
            print("running; Ctrl-C to stop", file=sys.stderr, flush=True)
            while registry.running:
                time.sleep(0.5)
            print("the registry exited; stopping", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0


def add_registry_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fetch-registry`` and ``run-registry``, added to ``python -m kstore_devbroker``'s commands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry-version", default=REGISTRY_VERSION, help=REGISTRY_VERSION)
    fetch = sub.add_parser("fetch-registry", parents=[common], help="download the schema registry (Apicurio)")
    fetch.set_defaults(func=_cmd_fetch_registry)
    run = sub.add_parser("run-registry", parents=[common], help="run the schema registry until Ctrl-C")
    run.add_argument("--port", type=int, default=None, help="default: a free one")
    run.add_argument("--data-dir", default=None,
                     help=f"where its schemas are kept, across restarts (default: {DEFAULT_DATA_DIR})")
    run.add_argument("--temp", action="store_true", help="a throwaway data folder, deleted when it stops")
    run.add_argument("--timeout", type=float, default=DEFAULT_REGISTRY_START_TIMEOUT)
    run.set_defaults(func=_cmd_run_registry)
