"""The secured development broker: every listener serves plain kafka-python 3 clients, and each
misconfiguration a user can make is refused.

What kafka-python 3.0.12 does with a refusal (seen here against Kafka 4.4): no constructor
raises the cause. KafkaProducer, KafkaConsumer and KafkaAdminClient all bootstrap in their
constructor (unless ``api_version`` is given) and retry with backoff until
``bootstrap_timeout_ms`` (default 30 s) runs out, then raise
``kafka.errors.KafkaTimeoutError('Unable to bootstrap from <servers>')``. The cause appears only
in the WARNING each attempt logs on ``kafka.net.manager``::

    Bootstrap connection to bootstrap-0 failed: <cause> (backoff 0.10 secs)

with these causes (``REFUSALS`` below checks them):

- wrong SCRAM or PLAIN password: ``[Error 58] SaslAuthenticationFailedError: ...`` (SCRAM:
  "Authentication failed during authentication due to invalid credentials with SASL mechanism
  SCRAM-SHA-512"; PLAIN: "Authentication failed: Invalid username or password") on some
  attempts and ``KafkaConnectionError: socket disconnected`` on others: the broker closes the
  connection right after its error reply and kafka-python often sees the close first (over TLS,
  6 of 8 attempts in one 10 s run);
- no client certificate on the mutual-TLS listener: ``KafkaConnectionError: [SSL:
  SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad certificate`` (TLS 1.3: the client's handshake
  has finished, the alert comes with the first read, so it is not a "Handshake failed");
- an expired client certificate: ``KafkaConnectionError: [SSL: SSLV3_ALERT_CERTIFICATE_UNKNOWN]
  sslv3 alert certificate unknown`` (nothing says "expired" on the client side);
- the broker's certificate names another host: ``KafkaConnectionError: Handshake failed: [SSL:
  CERTIFICATE_VERIFY_FAILED] certificate verify failed: IP address mismatch, certificate is not
  valid for '127.0.0.1'.``;
- the broker's certificate is from a CA the client does not trust: ``KafkaConnectionError:
  Handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed
  certificate in certificate chain``;
- a rejected OAUTHBEARER token (no ``sub``, no ``exp``, expired): ``[Error 58]
  SaslAuthenticationFailedError: {"status":"invalid_token"}`` (or "socket disconnected");
- a plaintext client on a TLS listener: ``InvalidReceiveError: Invalid frame length: 352518912``
  (the TLS alert's first bytes, 0x15030300, read as a length) or "socket disconnected".

An attempt that starts just before the deadline can also log ``[Error 7] RequestTimedOutError:
Request timed out after N ms``: the request timeout is cut to what is left of the bootstrap time.

The OAUTHBEARER token the broker's default unsecured validator accepts is an unsigned JWS,
``base64url({"alg":"none"}) + "." + base64url(claims) + "."`` (empty signature, no padding),
whose claims need ``sub`` (the principal) and ``exp`` (in the future; without it the token is
refused); ``iat`` is optional and ``scope`` is not needed (no required scope is configured).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaTimeoutError
from kafka.net.sasl.oauth import AbstractTokenProvider

from kstore_devbroker.broker import SecuredEndpoints

#: A refused client gives up after this; the cause is in the log long before.
REFUSAL_TIMEOUT_MS = 1500


def _b64(claims: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()


def unsecured_jwt(**claims: Any) -> str:
    """An unsigned JWT (``alg: none``), as Kafka's default OAUTHBEARER validator accepts."""
    return f"{_b64({'alg': 'none'})}.{_b64(claims)}."


class StaticToken(AbstractTokenProvider):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    def token(self) -> str:
        return self._token


def valid_claims() -> dict[str, Any]:
    now = int(time.time())
    return {"sub": "kstore-oauth", "iat": now, "exp": now + 3600}


def client_configs(ep: SecuredEndpoints) -> dict[str, dict[str, Any]]:
    """kafka-python options for each way in that must work."""
    scram = {"security_protocol": "SASL_SSL", "sasl_mechanism": ep.scram_mechanism,
             "sasl_plain_username": ep.scram_user, "sasl_plain_password": ep.scram_password}
    mtls = {"security_protocol": "SSL", "ssl_cafile": ep.ca_file, "ssl_certfile": ep.client_cert_file}
    return {
        "sasl_ssl_scram": {"bootstrap_servers": ep.sasl_ssl, **scram, "ssl_cafile": ep.ca_file},
        "mutual_tls": {"bootstrap_servers": ep.ssl, **mtls, "ssl_keyfile": ep.client_key_file},
        "mutual_tls_encrypted_key": {"bootstrap_servers": ep.ssl, **mtls, "ssl_keyfile": ep.client_key_encrypted_file,
                                     "ssl_password": ep.client_key_password},
        "sasl_plaintext_plain": {"bootstrap_servers": ep.sasl_plaintext, "security_protocol": "SASL_PLAINTEXT",
                                 "sasl_mechanism": "PLAIN", "sasl_plain_username": ep.plain_user,
                                 "sasl_plain_password": ep.plain_password},
        "sasl_plaintext_oauthbearer": {"bootstrap_servers": ep.sasl_plaintext, "security_protocol": "SASL_PLAINTEXT",
                                       "sasl_mechanism": "OAUTHBEARER",
                                       "sasl_oauth_token_provider": StaticToken(unsecured_jwt(**valid_claims()))},
        "wrong_hostname_unchecked": {"bootstrap_servers": ep.wrong_hostname, "security_protocol": "SSL",
                                     "ssl_cafile": ep.ca_file, "ssl_check_hostname": False},
    }


@pytest.fixture(scope="module")
def secure_topic(secure_kafka: SecuredEndpoints) -> Iterator[str]:
    topic = f"sec-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=secure_kafka.plaintext)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)], wait_for_metadata=True)
    finally:
        admin.close()
    yield topic


WAYS_IN = ["sasl_ssl_scram", "mutual_tls", "mutual_tls_encrypted_key", "sasl_plaintext_plain",
           "sasl_plaintext_oauthbearer", "wrong_hostname_unchecked"]


@pytest.mark.parametrize("way", WAYS_IN)
def test_produce_and_consume(way: str, secure_kafka: SecuredEndpoints, secure_topic: str) -> None:
    config = client_configs(secure_kafka)[way]
    value = f"{way}-{uuid.uuid4().hex}".encode()
    admin = KafkaAdminClient(**config)
    try:
        assert secure_topic in admin.list_topics()
    finally:
        admin.close()
    producer = KafkaProducer(**config, acks="all")
    try:
        sent = producer.send(secure_topic, value).get(timeout=30)
    finally:
        producer.close()
    consumer = KafkaConsumer(**config, enable_auto_commit=False, consumer_timeout_ms=20000)
    try:
        partition = TopicPartition(secure_topic, sent.partition)
        consumer.assign([partition])
        consumer.seek(partition, sent.offset)
        record = next(iter(consumer))
    finally:
        consumer.close(autocommit=False)
    assert (record.offset, record.value) == (sent.offset, value)


def _refusals(ep: SecuredEndpoints) -> dict[str, tuple[dict[str, Any], str]]:
    """Each wrong way in: kafka-python options and a regex every logged cause matches."""
    ways = client_configs(ep)
    sasl_failed_or_closed = r"SaslAuthenticationFailedError: {}|KafkaConnectionError: socket disconnected"
    invalid_token = sasl_failed_or_closed.format(r'\{"status":"invalid_token"\}')
    now = int(time.time())
    oauth = ways["sasl_plaintext_oauthbearer"]

    def token(**claims: Any) -> dict[str, Any]:
        return {**oauth, "sasl_oauth_token_provider": StaticToken(unsecured_jwt(**claims))}

    no_cert = {k: v for k, v in ways["mutual_tls"].items() if k not in ("ssl_certfile", "ssl_keyfile")}
    untrusted = r"Handshake failed: \[SSL: CERTIFICATE_VERIFY_FAILED\] .*self-signed certificate in certificate chain"
    return {
        "wrong_scram_password": (
            {**ways["sasl_ssl_scram"], "sasl_plain_password": "not-the-password"},
            sasl_failed_or_closed.format("Authentication failed during authentication due to invalid credentials"),
        ),
        "wrong_plain_password": (
            {**ways["sasl_plaintext_plain"], "sasl_plain_password": "not-the-password"},
            sasl_failed_or_closed.format("Authentication failed: Invalid username or password"),
        ),
        "no_client_certificate": (no_cert, r"SSLV3_ALERT_BAD_CERTIFICATE"),
        "expired_client_certificate": (
            {**no_cert, "ssl_certfile": ep.expired_cert_file, "ssl_keyfile": ep.expired_key_file},
            r"SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        ),
        "wrong_hostname_checked": (
            {**ways["wrong_hostname_unchecked"], "ssl_check_hostname": True},
            r"Handshake failed: \[SSL: CERTIFICATE_VERIFY_FAILED\] .*IP address mismatch",
        ),
        "untrusted_broker_ca": ({**ways["sasl_ssl_scram"], "ssl_cafile": ep.other_ca_file}, untrusted),
        "untrusted_broker_ca_mutual_tls": ({**ways["mutual_tls"], "ssl_cafile": ep.other_ca_file}, untrusted),
        "oauth_token_without_sub": (token(iat=now, exp=now + 3600), invalid_token),
        "oauth_token_without_exp": (token(sub="kstore-oauth", iat=now), invalid_token),
        "oauth_token_expired": (token(sub="kstore-oauth", iat=now - 7200, exp=now - 3600), invalid_token),
        "plaintext_client_on_tls_listener": (
            {"bootstrap_servers": ep.sasl_ssl},
            r"InvalidReceiveError: Invalid frame length|KafkaConnectionError: socket disconnected",
        ),
    }


REFUSALS = ["wrong_scram_password", "wrong_plain_password", "no_client_certificate", "expired_client_certificate",
            "wrong_hostname_checked", "untrusted_broker_ca", "untrusted_broker_ca_mutual_tls",
            "oauth_token_without_sub", "oauth_token_without_exp", "oauth_token_expired",
            "plaintext_client_on_tls_listener"]


#: Causes any attempt may log besides the case's own: the last connect or request cut by what is
#: left of the bootstrap deadline (on a loaded machine the TLS handshake itself can outlast it, and
#: so can the ApiVersions request after a handshake whose refusal the broker sends late), or the
#: broker's close seen before its answer.
_TRANSIENT = (r"RequestTimedOutError: Request timed out after \d+ ms|KafkaConnectionError: Connection timed out"
              r"|KafkaTimeoutError: Timeout during ApiVersions check"
              r"|socket disconnected|Connection reset by peer|SASL Authentication timed out")


def _bootstrap_causes(caplog: pytest.LogCaptureFixture) -> list[str]:
    prefix = "Bootstrap connection to bootstrap-0 failed: "
    return [r.getMessage()[len(prefix):] for r in caplog.records if r.getMessage().startswith(prefix)]


def _assert_refused(make: Any, config: dict[str, Any], cause: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kafka")
    started = time.monotonic()
    with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap from"):
        client = make(**config, bootstrap_timeout_ms=REFUSAL_TIMEOUT_MS)
        client.close()
    took = time.monotonic() - started
    causes = _bootstrap_causes(caplog)
    assert any(re.search(cause, c) for c in causes), (took, causes)
    assert all(re.search(f"{cause}|{_TRANSIENT}", c) for c in causes), (took, causes)
    # It retries until the timeout: the cause never ends the wait early.
    assert took > REFUSAL_TIMEOUT_MS / 1000 - 0.2, (took, causes)


@pytest.mark.parametrize("case", REFUSALS)
def test_refused(case: str, secure_kafka: SecuredEndpoints, caplog: pytest.LogCaptureFixture) -> None:
    config, cause = _refusals(secure_kafka)[case]
    _assert_refused(KafkaAdminClient, config, cause, caplog)


@pytest.mark.parametrize("make", [KafkaProducer, KafkaConsumer], ids=["producer", "consumer"])
def test_producer_and_consumer_are_refused_the_same_way(make: Any, secure_kafka: SecuredEndpoints,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    config, cause = _refusals(secure_kafka)["wrong_scram_password"]
    _assert_refused(make, config, cause, caplog)


def test_oauth_token_needs_only_sub_and_exp(secure_kafka: SecuredEndpoints, secure_topic: str) -> None:
    config = {**client_configs(secure_kafka)["sasl_plaintext_oauthbearer"],
              "sasl_oauth_token_provider": StaticToken(unsecured_jwt(sub="someone", exp=int(time.time()) + 600))}
    admin = KafkaAdminClient(**config)
    try:
        assert secure_topic in admin.list_topics()
    finally:
        admin.close()


def test_certificate_files(secure_kafka: SecuredEndpoints) -> None:
    """The client certificate chains to the CA; the expired one too, but it is expired; the other
    CA signed neither; the broker's certificates name the right (and the wrong) hosts."""
    ep = secure_kafka

    def verify(ca: str, cert: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["openssl", "verify", "-CAfile", ca, cert], capture_output=True, text=True, check=False)

    assert verify(ep.ca_file, ep.client_cert_file).returncode == 0
    expired = verify(ep.ca_file, ep.expired_cert_file)
    assert expired.returncode != 0 and "certificate has expired" in expired.stdout + expired.stderr
    assert verify(ep.other_ca_file, ep.client_cert_file).returncode != 0
    for path in (ep.client_key_file, ep.expired_key_file, ep.client_key_encrypted_file):
        assert os.stat(path).st_mode & 0o077 == 0, f"{path} is readable by others"
    assert "ENCRYPTED PRIVATE KEY" in Path(ep.client_key_encrypted_file).read_text()

