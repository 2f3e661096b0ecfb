"""kstore against a secured cluster: the real Apache Kafka broker authenticates (SCRAM, PLAIN,
OAUTHBEARER, client certificates) and PostgreSQL speaks TLS (sslmode=verify-full).

Each way in drains a topic exactly once; each way of getting it wrong is one clear line, exit 2,
no secret printed, answered well before the connect timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from sqlalchemy.engine import make_url

from kstore_devbroker.broker import SecuredEndpoints
from tests.conftest import KAFKA_CLIENT
from tests.support.harness import SUPPORT_DIR, assert_exactly_once, effects, wait_until, without_kafka_python

Sent = set[tuple[str, int, int]]
#: Long enough that an answer given only at the timeout is obvious; the probe answers in well under it.
CONNECT_TIMEOUT_S = 20.0


@pytest.fixture
def secure_topic(secure_kafka: SecuredEndpoints) -> Iterator[Callable[[list[str]], tuple[str, Sent]]]:
    """Create a 2-partition topic on the secured broker and produce values to it (over its plaintext listener)."""
    admin = KafkaAdminClient(bootstrap_servers=secure_kafka.plaintext)
    producer = KafkaProducer(bootstrap_servers=secure_kafka.plaintext)

    def make(values: list[str]) -> tuple[str, set[tuple[str, int, int]]]:
        topic = f"s-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
        futures = [producer.send(topic, v.encode()) for v in values]
        producer.flush()
        sent = {(m.topic, m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)}
        return topic, sent

    yield make
    producer.close()
    admin.close()


def secret_file(tmp_path: Path, name: str, secret: str) -> str:
    path = tmp_path / name
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def scram_args(ep: SecuredEndpoints, tmp_path: Path, password: str | None = None) -> list[str]:
    return ["--bootstrap-servers", ep.sasl_ssl, "--security-protocol", "SASL_SSL",
            "--sasl-mechanism", "SCRAM-SHA-512", "--sasl-username", ep.scram_user,
            "--sasl-password-file", secret_file(tmp_path, "sasl-password", password or ep.scram_password),
            "--ssl-cafile", ep.ca_file]


def mtls_args(ep: SecuredEndpoints, cert: str | None = None, key: str | None = None) -> list[str]:
    return ["--bootstrap-servers", ep.ssl, "--security-protocol", "SSL", "--ssl-cafile", ep.ca_file,
            "--ssl-certfile", cert or ep.client_cert_file, "--ssl-keyfile", key or ep.client_key_file]


def drain(workers: Any, dsn: str, topic: str, sent: set[tuple[str, int, int]], args: list[str],
          env: dict[str, str] | None = None) -> str:
    w = workers(dsn, topic, f"g-{topic}", args=args, env=env)
    wait_until(lambda: len(effects(dsn)) >= len(sent), 90, what="every message processed")
    assert w.terminate() == 0
    assert_exactly_once(effects(dsn), sent)
    return w.log


def test_worker_drains_exactly_once_over_sasl_ssl_scram(secure_kafka: SecuredEndpoints, secure_topic: Any,
                                                       pg_dsn: str, workers: Any, tmp_path: Path) -> None:
    topic, sent = secure_topic([f"scram{i}" for i in range(300)])
    log = drain(workers, pg_dsn, topic, sent, scram_args(secure_kafka, tmp_path))
    assert secure_kafka.scram_password not in log


def test_worker_drains_exactly_once_over_mutual_tls(secure_kafka: SecuredEndpoints, secure_topic: Any,
                                                   pg_dsn: str, workers: Any) -> None:
    topic, sent = secure_topic([f"mtls{i}" for i in range(300)])
    drain(workers, pg_dsn, topic, sent, mtls_args(secure_kafka))


def test_worker_drains_exactly_once_with_an_encrypted_client_key(secure_kafka: SecuredEndpoints,
                                                                secure_topic: Any, pg_dsn: str, workers: Any,
                                                                tmp_path: Path) -> None:
    topic, sent = secure_topic([f"enc{i}" for i in range(100)])
    ep = secure_kafka
    log = drain(workers, pg_dsn, topic, sent, mtls_args(ep, key=ep.client_key_encrypted_file),
                env={"KSTORE_SSL_KEY_PASSWORD_FILE": secret_file(tmp_path, "key-pw", ep.client_key_password)})
    assert ep.client_key_password not in log


def test_worker_drains_exactly_once_over_sasl_plaintext_plain(secure_kafka: SecuredEndpoints, secure_topic: Any,
                                                             pg_dsn: str, workers: Any) -> None:
    """PLAIN, with the settings as KSTORE_* variables, the password too (as a container would set them)."""
    topic, sent = secure_topic([f"plain{i}" for i in range(300)])
    env = {"KSTORE_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KSTORE_SASL_MECHANISM": "PLAIN",
           "KSTORE_SASL_USERNAME": secure_kafka.plain_user, "KSTORE_SASL_PASSWORD": secure_kafka.plain_password}
    log = drain(workers, pg_dsn, topic, sent, ["--bootstrap-servers", secure_kafka.sasl_plaintext], env=env)
    assert secure_kafka.plain_password not in log


def test_worker_drains_exactly_once_over_oauthbearer(secure_kafka: SecuredEndpoints, secure_topic: Any,
                                                    pg_dsn: str, workers: Any) -> None:
    """The token comes from a MODULE:CALLABLE (tests/support/processors.py:oauth_token)."""
    topic, sent = secure_topic([f"oauth{i}" for i in range(100)])
    drain(workers, pg_dsn, topic, sent,
          ["--bootstrap-servers", secure_kafka.sasl_plaintext, "--security-protocol", "SASL_PLAINTEXT",
           "--sasl-mechanism", "OAUTHBEARER", "--sasl-oauth-token-provider", "processors:oauth_token"])


def test_kafka_options_reach_the_consumer(secure_kafka: SecuredEndpoints, secure_topic: Any, pg_dsn: str,
                                          workers: Any) -> None:
    """--kafka-option and KSTORE_KAFKA_* set the client's options (kafka-python's, or librdkafka's with
    the confluent backend): the consumer is made with both."""
    topic, sent = secure_topic([f"opt{i}" for i in range(50)])
    group = f"g-{topic}"
    fetch_wait = "fetch.wait.max.ms" if KAFKA_CLIENT == "confluent" else "fetch_max_wait_ms"
    w = workers(pg_dsn, topic, group, env={"KSTORE_KAFKA_ISOLATION_LEVEL": "read_uncommitted"},
                args=["--bootstrap-servers", secure_kafka.plaintext, "--kafka-option", f"{fetch_wait}=100"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message processed")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
    if KAFKA_CLIENT == "confluent":
        assert "fetch.wait.max.ms='100'" in w.log and "isolation.level='read_uncommitted'" in w.log
    else:
        assert "fetch_max_wait_ms=100" in w.log and "isolation_level='read_uncommitted'" in w.log


def kstore(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kstore", *args], capture_output=True, text=True, cwd=SUPPORT_DIR,
                       timeout=CONNECT_TIMEOUT_S * 3,
                       env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR),
                            "KSTORE_CONNECT_TIMEOUT_S": str(CONNECT_TIMEOUT_S), **(env or {})})
    return r, time.monotonic() - started


def test_offsets_show_over_sasl_ssl(secure_kafka: SecuredEndpoints, secure_topic: Any, pg_dsn: str, workers: Any,
                                    tmp_path: Path) -> None:
    topic, sent = secure_topic([f"show{i}" for i in range(40)])
    drain(workers, pg_dsn, topic, sent, scram_args(secure_kafka, tmp_path))
    r, _ = kstore("offsets", "show", "--group", f"g-{topic}", "--dsn", pg_dsn, "--json",
                  *scram_args(secure_kafka, tmp_path))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(row["partition"], row["next_offset"], row["log_end"], row["lag"]) for row in rows} == {
        (p, n, n, 0) for p in (0, 1) for n in [1 + max(o for _, pp, o in sent if pp == p)]}
    assert secure_kafka.scram_password not in r.stdout + r.stderr
    # A wrong password, where kafka-python (whose SASL mechanisms the probe logs in with) is not
    # installed: librdkafka's refusal is the answer, in one line, before the connect timeout.
    wrong = "not-the-Password-42"
    path = os.pathsep.join([without_kafka_python(tmp_path), str(SUPPORT_DIR)])
    r, took = kstore("offsets", "show", "--group", f"g-{topic}", "--dsn", pg_dsn,
                     *scram_args(secure_kafka, tmp_path, password=wrong),
                     env={"PYTHONPATH": path, "KSTORE_KAFKA_CLIENT": "confluent"})
    assert_refused(r, took, "Authentication failed", secrets=(wrong, secure_kafka.scram_password))


def assert_refused(r: subprocess.CompletedProcess[str], elapsed: float, *needles: str,
                   secrets: tuple[str, ...] = ()) -> None:
    """Exit 2, one line naming the cause, no secret, no traceback, well before the connect timeout."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{r.stderr}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert "Traceback" not in r.stderr + r.stdout
    for secret in secrets:
        assert secret not in r.stderr + r.stdout
    assert elapsed < CONNECT_TIMEOUT_S * 0.75, f"answered after {elapsed:.1f}s: it waited for the timeout"


@pytest.fixture
def refused(secure_kafka: SecuredEndpoints, secure_topic: Any, sqlite_dsn: str) -> Callable[..., Any]:
    """Run `kstore worker` with the given connection arguments; return (result, seconds)."""
    topic, _ = secure_topic(["x"])

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
        return kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--group", "refused", "--topic", topic,
                      *args, env=env)

    return run


def test_wrong_sasl_password(secure_kafka: SecuredEndpoints, refused: Any, tmp_path: Path) -> None:
    wrong = "not-the-Password-42"
    r, took = refused(*scram_args(secure_kafka, tmp_path, password=wrong))
    assert_refused(r, took, "refused SASL SCRAM-SHA-512 authentication", repr(secure_kafka.scram_user),
                   secrets=(wrong, secure_kafka.scram_password))


def test_wrong_sasl_password_without_kafka_python(secure_kafka: SecuredEndpoints, refused: Any,
                                                  tmp_path: Path) -> None:
    """``pip install kstore`` has no kafka-python, whose SASL mechanisms the probe logs in with: then
    librdkafka's refusal ends the wait, as soon and in the same line."""
    wrong = "not-the-Password-42"
    path = os.pathsep.join([without_kafka_python(tmp_path), str(SUPPORT_DIR)])
    r, took = refused(*scram_args(secure_kafka, tmp_path, password=wrong),
                      env={"PYTHONPATH": path, "KSTORE_KAFKA_CLIENT": "confluent"})
    assert_refused(r, took, "refused SASL SCRAM-SHA-512 authentication", repr(secure_kafka.scram_user),
                   secrets=(wrong, secure_kafka.scram_password))


def test_sasl_mechanism_the_listener_does_not_enable(secure_kafka: SecuredEndpoints, refused: Any,
                                                     tmp_path: Path) -> None:
    args = scram_args(secure_kafka, tmp_path)
    args[args.index("SCRAM-SHA-512")] = "SCRAM-SHA-256"
    r, took = refused(*args)
    assert_refused(r, took, "does not enable SASL mechanism SCRAM-SHA-256", "it enables: SCRAM-SHA-512",
                   secrets=(secure_kafka.scram_password,))


def test_sasl_mechanism_kstore_does_not_know(refused: Any) -> None:
    r, took = refused("--security-protocol", "SASL_SSL", "--sasl-mechanism", "SCRAM-SHA-1")
    assert_refused(r, took, "unknown sasl_mechanism 'SCRAM-SHA-1'")


def test_untrusted_broker_certificate(secure_kafka: SecuredEndpoints, refused: Any, tmp_path: Path) -> None:
    args = scram_args(secure_kafka, tmp_path)
    args[args.index(secure_kafka.ca_file)] = secure_kafka.other_ca_file
    r, took = refused(*args)
    assert_refused(r, took, "certificate is not trusted", "ssl_cafile", secrets=(secure_kafka.scram_password,))


def test_wrong_hostname_in_the_broker_certificate(secure_kafka: SecuredEndpoints, refused: Any) -> None:
    args = ["--bootstrap-servers", secure_kafka.wrong_hostname, "--security-protocol", "SSL",
            "--ssl-cafile", secure_kafka.ca_file]
    r, took = refused(*args)
    assert_refused(r, took, "certificate is not for '127.0.0.1'")


def test_expired_client_certificate(secure_kafka: SecuredEndpoints, refused: Any) -> None:
    r, took = refused(*mtls_args(secure_kafka, secure_kafka.expired_cert_file, secure_kafka.expired_key_file))
    assert_refused(r, took, "client certificate", "expired on 2020-")


def test_no_client_certificate_on_a_mutual_tls_listener(secure_kafka: SecuredEndpoints, refused: Any) -> None:
    r, took = refused("--bootstrap-servers", secure_kafka.ssl, "--security-protocol", "SSL",
                      "--ssl-cafile", secure_kafka.ca_file)
    assert_refused(r, took, "requires a client certificate", "ssl_certfile")


def test_plaintext_client_against_a_tls_listener(secure_kafka: SecuredEndpoints, refused: Any) -> None:
    r, took = refused("--bootstrap-servers", secure_kafka.ssl)
    assert_refused(r, took, "is a TLS listener: set security_protocol to SSL or SASL_SSL")


def test_tls_client_against_a_plaintext_listener(secure_kafka: SecuredEndpoints, refused: Any) -> None:
    r, took = refused("--bootstrap-servers", secure_kafka.plaintext, "--security-protocol", "SSL",
                      "--ssl-cafile", secure_kafka.ca_file)
    assert_refused(r, took, "does not speak TLS")


def test_plaintext_client_against_a_sasl_listener(secure_kafka: SecuredEndpoints, refused: Any) -> None:
    r, took = refused("--bootstrap-servers", secure_kafka.sasl_plaintext)
    assert_refused(r, took, "expects SASL authentication", "SASL_PLAINTEXT")


def tls_connections(dsn: str) -> int:
    """Other sessions on this database that use TLS (the worker's, while it runs)."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(
                "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
                "WHERE s.ssl AND a.datname = current_database() AND a.pid <> pg_backend_pid()")).scalar_one())
    finally:
        engine.dispose()


def test_every_database_path_over_tls_verify_full(pg_tls_dsn: str, kafka: str, new_topic: Any, produce: Any,
                                                  workers: Any, tmp_path: Path) -> None:
    """sslmode=verify-full through migrate, the worker, offsets show and dead letters (DSN from a file)."""
    assert "sslmode=verify-full" in pg_tls_dsn
    dsn_file = secret_file(tmp_path, "dsn", pg_tls_dsn)
    r, _ = kstore("migrate", "--dsn-file", dsn_file)
    assert r.returncode == 0, r.stderr
    topic = new_topic(2)
    sent = set(produce(topic, [f"tls{i}" for i in range(200)]))
    w = workers(pg_tls_dsn, topic, "tls")
    wait_until(lambda: len(effects(pg_tls_dsn)) >= len(sent), 60, what="every message processed")
    assert tls_connections(pg_tls_dsn) >= 1, "the worker's connections do not use TLS"
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_tls_dsn), sent)
    r, _ = kstore("offsets", "show", "--group", "tls", "--dsn-file", dsn_file, "--bootstrap-servers", kafka, "--json")
    assert r.returncode == 0, r.stderr
    assert sum(row["next_offset"] for row in json.loads(r.stdout)) == len(sent)
    r, _ = kstore("dead-letters", "list", "--group", "tls", "--dsn-file", dsn_file)
    assert r.returncode == 0, r.stderr


def test_database_certificate_from_an_untrusted_ca_is_refused(pg_tls_dsn: str, secure_kafka: SecuredEndpoints) -> None:
    """verify-full against a CA that did not sign the server's certificate: one clear line, exit 2."""
    url = make_url(pg_tls_dsn)
    dsn = url.update_query_dict({"sslrootcert": secure_kafka.other_ca_file}).render_as_string(hide_password=False)
    r, _ = kstore("migrate", "--dsn", dsn)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "certificate verify failed" in r.stderr, r.stderr


def test_no_secret_in_debug_output_or_help(secure_kafka: SecuredEndpoints, refused: Any, tmp_path: Path,
                                           pg_dsn: str) -> None:
    """With --debug (tracebacks, kstore's and kafka-python's debug logs) a failing login through the
    whole path prints neither the SASL password nor the database password; --help shows no default.
    (The test server trusts local connections: the DSN's password is carried everywhere, never checked.)"""
    ep, wrong, db_password = secure_kafka, "wrong-Secret-77", "db-Secret-99"
    dsn = make_url(pg_dsn).set(password=db_password).render_as_string(hide_password=False)
    r, _ = kstore("--debug", "offsets", "show", "--group", "g", "--dsn", dsn, *scram_args(ep, tmp_path, password=wrong))
    assert r.returncode == 2 and "refused SASL SCRAM-SHA-512 authentication" in r.stderr, r.stderr
    assert "Traceback" in r.stderr  # --debug did show it
    for secret in (wrong, db_password):
        assert secret not in r.stdout + r.stderr
    r, _ = kstore("worker", "--help", env={"KSTORE_SASL_PASSWORD": wrong, "KSTORE_DSN": dsn})
    assert r.returncode == 0 and "--sasl-password-file" in r.stdout
    assert wrong not in r.stdout and db_password not in r.stdout
