"""The services a benchmark run needs: a local Kafka broker, a throwaway PostgreSQL, and a schema
registry when an Avro contender runs.

All are optional: ``--bootstrap-servers``, ``--dsn`` and ``--schema-registry-url`` point the run
at ones that already exist, and then nothing is started here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kstore_devbroker.broker import Cluster

#: The broker runs with the JVM's full JIT (devbroker's default stops at C1 to start
#: faster, at a cost in steady-state speed that a benchmark would measure), and a
#: larger heap than the tests use, so the broker is not what limits a contender.
BROKER_JVM_OPTIONS = ("-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
BROKER_HEAP = "1g"
BROKER_CONFIG = {"auto.create.topics.enable": "false"}


@contextlib.contextmanager
def local_kafka() -> Iterator[str]:
    """A one-node Apache Kafka (kstore_devbroker.broker) for the run; yields its bootstrap address."""
    cluster = Cluster(1, heap=BROKER_HEAP, jvm_options=BROKER_JVM_OPTIONS, extra_config=BROKER_CONFIG)
    cluster.start()
    try:
        yield cluster.bootstrap_servers
    finally:
        cluster.stop()


@contextlib.contextmanager
def local_registry() -> Iterator[str]:
    """A schema registry with Confluent's API (kstore_devbroker.registry: Apicurio Registry, Java 21+,
    fetched and cached at its first use) for the Avro contenders; yields its URL."""
    from kstore_devbroker.registry import DevRegistry

    with DevRegistry() as registry:  # its schemas in a temporary folder, deleted when it stops
        yield registry.url


def pg_bin_dir() -> Path:
    """The newest PostgreSQL server binaries installed from Debian's packages (or on PATH)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=_major_version)
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql (or pass --dsn)")


def _major_version(pg_ctl: Path) -> int:
    match = re.search(r"/(\d+)/bin/", str(pg_ctl))
    return int(match.group(1)) if match else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _as_postgres() -> list[str]:
    # PostgreSQL refuses to run as root: as root, run its tools as `postgres`
    # (the same recipe as examples/postgres_demo.sh).
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@dataclass(frozen=True)
class LocalPostgres:
    dsn: str
    #: The postmaster: it detaches from pg_ctl, so the noise meter must be told it is ours.
    pid: int


@contextlib.contextmanager
def local_postgres() -> Iterator[LocalPostgres]:
    """A throwaway PostgreSQL (initdb + pg_ctl in a temp dir) with default settings."""
    bin_dir = pg_bin_dir()
    work = Path(tempfile.mkdtemp(prefix="kstore-bench-pg-"))
    if os.geteuid() == 0:
        shutil.chown(work, "postgres", "postgres")
    data, port = work / "data", _free_port()
    run = _as_postgres()
    pg_ctl = [*run, str(bin_dir / "pg_ctl"), "-D", str(data)]
    try:
        _quiet("initdb", [*run, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"])
        options = f"-p {port} -k {work} -c listen_addresses=127.0.0.1"
        _quiet("pg_ctl start", [*pg_ctl, "-o", options, "-l", str(work / "log"), "-w", "start"])
        pid = int((data / "postmaster.pid").read_text().split()[0])
        yield LocalPostgres(f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres", pid)
    finally:
        subprocess.run([*pg_ctl, "stop", "-m", "fast"], capture_output=True, check=False, cwd="/")
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def local_postgres_dsn() -> Iterator[str]:
    """:func:`local_postgres`'s DSN, for a benchmark that needs nothing else of it."""
    with local_postgres() as pg:
        yield pg.dsn


def _quiet(what: str, cmd: list[str]) -> None:
    # cwd=/ because `postgres` may not be allowed into the caller's directory.
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stdout}{done.stderr}")
