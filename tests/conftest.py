"""Fixtures: a real Kafka broker, a real PostgreSQL, topics, producers and worker processes.

Nothing here is mocked. A service that cannot be started fails the test
session; it never skips.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from pytest_postgresql import factories

from kstore import Settings, migrate
from kstore_devbroker.broker import Cluster, SecuredBroker, SecuredEndpoints
from kstore_devbroker.certs import CertificateAuthority
from kstore_devbroker.registry import DevRegistry
from tests.support.harness import SUPPORT_DIR, WorkerProcess, wait_until
from tests.support.processors import metadata as effects_metadata

# PostgreSQL refuses to run as root; the wrapper runs only pg_ctl as `postgres`. Logical decoding
# (the outbox's WAL transport reads a replication slot) needs wal_level=logical and free slots.
postgresql_proc = factories.postgresql_proc(
    executable=str(SUPPORT_DIR / "pg_ctl_as_postgres.sh"),
    postgres_options="-c wal_level=logical -c max_replication_slots=20 -c max_wal_senders=20",
)
postgresql = factories.postgresql("postgresql_proc")
#: A second server that checks passwords (initdb --auth=password), for the wrong-password case.
PG_PASSWORD = "pg-s3cret-Pw"
postgresql_pw_proc = factories.postgresql_proc(executable=str(SUPPORT_DIR / "pg_ctl_as_postgres.sh"),
                                               password=PG_PASSWORD, port=None)
#: A server of its own for the test that stops and starts PostgreSQL mid-run, so that a restart
#: that goes wrong on a loaded machine cannot take every later test's database with it.
postgresql_outage_proc = factories.postgresql_proc(executable=str(SUPPORT_DIR / "pg_ctl_as_postgres.sh"), port=None)
postgresql_outage = factories.postgresql("postgresql_outage_proc")
#: A third server with TLS (ssl=on). Its certificate and key are made by `pg_tls_files` before it
#: starts, at a path fixed now because pytest-postgresql takes the server options when the
#: fixture is defined (the pid keeps parallel sessions apart).
_PG_TLS_DIR = Path(tempfile.gettempdir()) / f"kstore-pg-tls-{os.getpid()}"
_postgresql_tls_server = factories.postgresql_proc(
    executable=str(SUPPORT_DIR / "pg_ctl_as_postgres.sh"), port=None,
    postgres_options=f"-c ssl=on -c ssl_cert_file={_PG_TLS_DIR / 'server.pem'} "
                     f"-c ssl_key_file={_PG_TLS_DIR / 'server.key'}",
)

#: The driver of `pg_dsn` and `pg_tls_dsn`: psycopg2, or `KSTORE_TEST_PG_DRIVER=psycopg` (psycopg 3)
#: to run every test that touches PostgreSQL through kstore on the other driver.
PG_DRIVER = os.environ.get("KSTORE_TEST_PG_DRIVER", "psycopg2")

#: The worker's Kafka client: confluent-kafka (the default), or `KSTORE_TEST_KAFKA_CLIENT=kafka-python` to
#: run the tests' workers (the spawned ones, and those built in the test with ``kafka_client=KAFKA_CLIENT``)
#: on the other client. The tests' own producers, admin clients and readers are kafka-python's.
KAFKA_CLIENT = os.environ.get("KSTORE_TEST_KAFKA_CLIENT", "confluent")
# And every `kstore` command the tests run, and every Settings.from_env() in them.
os.environ["KSTORE_KAFKA_CLIENT"] = KAFKA_CLIENT


#: Where each test session's base temp goes when ``--basetemp`` is not given. pytest's own root,
#: ``/tmp/pytest-of-<user>``, is reset to mode 0700 by every pytest session that starts without
#: ``--basetemp`` (anyone's, for any project); the PostgreSQL servers below run as ``postgres`` and
#: would lose their data directory then. This root is kstore's: nothing resets it.
SESSIONS_ROOT = Path(tempfile.gettempdir()) / "kstore-pytest"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A base temp of the session's own under :data:`SESSIONS_ROOT` (before pytest's temp
    factory reads the option; xdist's workers get theirs below the controller's)."""
    if config.option.basetemp or hasattr(config, "workerinput"):
        return
    SESSIONS_ROOT.mkdir(exist_ok=True)
    SESSIONS_ROOT.chmod(0o711)  # others may traverse (postgres), not list
    for old in SESSIONS_ROOT.glob("pid-*"):
        if not _running(int(old.name.split("-")[1])):
            shutil.rmtree(old, ignore_errors=True)
    config.option.basetemp = tempfile.mkdtemp(prefix=f"pid-{os.getpid()}-", dir=SESSIONS_ROOT)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests (and those starting a cluster of their own) first, otherwise in their order:
    under pytest-xdist the last test to start bounds the run, and a long one started last keeps
    one worker busy after the other has finished."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("long") or item.get_closest_marker("cluster") else 1)


def pytest_report_header() -> str:
    """The versions the run is against, at the top of its output: SQLAlchemy's private names
    (tests/unit/db/test_session_sqlalchemy_names.py) and the drivers are checked on these."""
    import importlib.metadata

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return ", ".join(f"{d} {version(d)}" for d in ("sqlalchemy", "psycopg2-binary", "psycopg", "kafka-python"))


#: Both Kafka clients: a test marked ``contract`` (what the seam between the engine and a client
#: promises) runs on each of them; any other test on KAFKA_CLIENT.
CLIENTS = ("confluent", "kafka-python")


def rebalance_protocols(client: str) -> tuple[str, ...]:
    """The rebalance protocols a worker can use on ``client`` (the ``rebalance_protocol`` fixture):
    eager only on kafka-python; eager, cooperative (cooperative-sticky) and consumer (KIP-848) on
    confluent-kafka."""
    return ("eager",) if client == "kafka-python" else ("eager", "cooperative", "consumer")


#: The rebalance protocols of KAFKA_CLIENT.
REBALANCE_PROTOCOLS = rebalance_protocols(KAFKA_CLIENT)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A ``contract`` test runs on each client (``kafka_client``), and a test that takes
    ``rebalance_protocol`` on each protocol of each client it runs on."""
    clients = CLIENTS if metafunc.definition.get_closest_marker("contract") is not None else (KAFKA_CLIENT,)
    if "rebalance_protocol" in metafunc.fixturenames:
        pairs = [(c, p) for c in clients for p in rebalance_protocols(c)]
        metafunc.parametrize(("kafka_client", "rebalance_protocol"), pairs, indirect=["kafka_client"],
                             ids=[f"{c}-{p}" if len(clients) > 1 else p for c, p in pairs])
    elif len(clients) > 1 and "kafka_client" in metafunc.fixturenames:
        metafunc.parametrize("kafka_client", clients, indirect=True)


@pytest.fixture
def kafka_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The Kafka client of this test's workers: each client for a ``contract`` test, else
    KAFKA_CLIENT. Also every ``kstore`` command and ``Settings.from_env()`` of the test."""
    client = str(getattr(request, "param", KAFKA_CLIENT))
    monkeypatch.setenv("KSTORE_KAFKA_CLIENT", client)
    return client

#: Broker settings for tests: topics exist only when a test creates them. Groups on the consumer
#: protocol (KIP-848) take their session timeout and heartbeat from the broker: the tests' 6 s and
#: 1 s (the broker's defaults are 45 s and 5 s, and refuse less).
BROKER_CONFIG = {"auto.create.topics.enable": "false",
                 "group.consumer.min.session.timeout.ms": "6000", "group.consumer.session.timeout.ms": "6000",
                 "group.consumer.min.heartbeat.interval.ms": "1000", "group.consumer.heartbeat.interval.ms": "1000"}
#: Worker settings for tests: short Kafka session so a killed worker's partitions move on quickly.
TEST_SESSION_TIMEOUT_MS = 6000




@pytest.fixture(scope="session")
def kafka() -> Iterator[str]:
    """Bootstrap address of a real Apache Kafka broker (or ``KSTORE_TEST_BOOTSTRAP``)."""
    external = os.environ.get("KSTORE_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    cluster = Cluster(1, extra_config=BROKER_CONFIG)
    cluster.start()
    try:
        yield cluster.bootstrap_servers
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def secure_kafka() -> Iterator[SecuredEndpoints]:
    """A second broker with SASL_SSL (SCRAM), mutual-TLS, SASL_PLAINTEXT (PLAIN, OAUTHBEARER) and
    wrong-hostname TLS listeners besides PLAINTEXT, with its CA, client certificates and users."""
    broker = SecuredBroker(extra_config=BROKER_CONFIG)
    broker.start()
    try:
        yield broker.endpoints
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevRegistry]:
    """A real schema registry (Apicurio Registry) with Confluent's API at ``.url``, one per test process.

    Its schemas live in a file: ``stop()`` then ``start()`` brings it back at the same ``url`` with
    the same schema ids. A test that stops it starts it again, in a ``finally``."""
    registry = DevRegistry(data_dir=tmp_path_factory.mktemp("schema-registry"))
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="session")
def admin(kafka: str) -> Iterator[Any]:
    client = KafkaAdminClient(bootstrap_servers=kafka)
    yield client
    client.close()


@pytest.fixture
def new_topic(kafka: str, admin: Any) -> Callable[..., str]:
    """Create a topic with a unique name: ``new_topic(partitions=4)``."""

    def create(partitions: int = 4, name: str | None = None) -> str:
        topic = name or f"t-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
        wait_until(lambda: _has_leaders(admin, topic, partitions), 30, what=f"leaders for {topic}")
        return topic

    return create


def _has_leaders(admin: Any, topic: str, partitions: int) -> bool:
    try:
        described = admin.describe_topics([topic])
    except Exception:  # the metadata may not have spread yet
        return False
    parts = described[0].get("partitions", []) if described else []
    return len(parts) == partitions and all(p.get("leader_id", -1) >= 0 for p in parts)


@pytest.fixture(scope="session")
def producer(kafka: str) -> Iterator[Any]:
    p = KafkaProducer(bootstrap_servers=kafka, acks="all", linger_ms=5)
    yield p
    p.close()


@pytest.fixture
def produce(producer: Any) -> Callable[..., list[tuple[str, int, int]]]:
    """Send values and wait for them: returns [(topic, partition, offset)] in send order."""

    def send(topic: str, values: Iterable[str | bytes], partition: int | None = None,
             key: bytes | None = None) -> list[tuple[str, int, int]]:
        futures = [
            producer.send(topic, value=v.encode() if isinstance(v, str) else v, partition=partition, key=key)
            for v in values
        ]
        producer.flush()
        sent = [f.get(timeout=30) for f in futures]
        return [(m.topic, m.partition, m.offset) for m in sent]

    return send


def _prepare(dsn: str) -> str:
    migrate(Settings(dsn=dsn))
    engine = sa.create_engine(dsn)
    effects_metadata.create_all(engine)
    engine.dispose()
    return dsn


@pytest.fixture
def pg_dsn(postgresql: Any) -> str:
    """A fresh PostgreSQL database with kstore's tables and the tests' effects table."""
    info = postgresql.info
    return _prepare(f"postgresql+{PG_DRIVER}://{info.user}@{info.host}:{info.port}/{info.dbname}")


@pytest.fixture
def pg_outage_dsn(postgresql_outage: Any) -> str:
    """Like ``pg_dsn``, on the server that ``postgresql_outage_proc`` stops and starts."""
    info = postgresql_outage.info
    return _prepare(f"postgresql+{PG_DRIVER}://{info.user}@{info.host}:{info.port}/{info.dbname}")


@dataclass(frozen=True)
class PgTlsFiles:
    """The TLS server's CA (clients verify against it) and an unrelated CA (which must fail)."""

    ca_file: Path
    other_ca_file: Path


@pytest.fixture(scope="session")
def pg_tls_files() -> Iterator[PgTlsFiles]:
    """Certificates for the TLS PostgreSQL server: for 127.0.0.1 and localhost, from a throwaway CA."""
    if _PG_TLS_DIR.exists():
        shutil.rmtree(_PG_TLS_DIR)
    ca = CertificateAuthority.create(_PG_TLS_DIR, "kstore-pg-ca")
    server = ca.issue("server", sans=("IP:127.0.0.1", "DNS:localhost"))
    other = CertificateAuthority.create(_PG_TLS_DIR / "other", "kstore-pg-other-ca")
    # The server runs as `postgres` when the tests run as root (tests/support/pg_ctl_as_postgres.sh), and
    # refuses a key that anyone but its owner can read: the key is postgres's, mode 0600.
    _PG_TLS_DIR.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(server.key, user="postgres", group="postgres")
    try:
        yield PgTlsFiles(ca.cert, other.cert)
    finally:
        shutil.rmtree(_PG_TLS_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def postgresql_tls_proc(pg_tls_files: PgTlsFiles, request: pytest.FixtureRequest) -> Any:
    """The PostgreSQL server with ssl=on (started after its certificate exists)."""
    return request.getfixturevalue("_postgresql_tls_server")


postgresql_tls = factories.postgresql("postgresql_tls_proc")


@pytest.fixture
def pg_tls_dsn(postgresql_tls: Any, pg_tls_files: PgTlsFiles) -> str:
    """Like ``pg_dsn``, on the TLS server, with ``sslmode=verify-full`` against its CA."""
    info = postgresql_tls.info
    return _prepare(f"postgresql+{PG_DRIVER}://{info.user}@{info.host}:{info.port}/{info.dbname}"
                    f"?sslmode=verify-full&sslrootcert={pg_tls_files.ca_file}")


@pytest.fixture
def sqlite_dsn(tmp_path: Path) -> str:
    return _prepare(f"sqlite:///{tmp_path / 'kstore.db'}")


@pytest.fixture
def workers(tmp_path: Path, kafka: str, kafka_client: str) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``kstore worker`` subprocesses; each is killed at the end of the test if still running."""
    started: list[WorkerProcess] = []

    def start(dsn: str, topic: str, group: str, processor: str = "processors:Recorder",
              env: dict[str, str] | None = None, args: Iterable[str] = ()) -> WorkerProcess:
        name = f"w{len(started) + 1}"
        full_env = {
            "KSTORE_SESSION_TIMEOUT_MS": str(TEST_SESSION_TIMEOUT_MS),
            "KSTORE_HEARTBEAT_INTERVAL_MS": "1000",
            "KSTORE_TEST_WORKER_NAME": name,
            "KSTORE_KAFKA_CLIENT": kafka_client,
            **(env or {}),
        }
        cli = ["--log-level", "DEBUG", "worker", processor, "--dsn", dsn, "--group", group, "--topic", topic,
               *(args if "--bootstrap-servers" in args else ["--bootstrap-servers", kafka, *args])]
        proc = WorkerProcess(cli, full_env, tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()
