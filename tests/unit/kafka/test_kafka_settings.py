"""Unit tests of how kstore is told to reach Kafka: security settings, any other client option (kafka-python's names),
secrets from files. Pure logic: nothing here connects (the secured broker tests do)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer
from kafka.net.sasl import SASL_MECHANISMS
from kafka.net.sasl.oauth import AbstractTokenProvider

from kstore import ConfigurationError, Settings
from kstore.kafka.kafkapython.connect import client_config, load_token_provider
from kstore.kafka.options import CONSUMER_OPTIONS, SASL_MECHANISM_NAMES, check_kafka_options
from kstore.kafka.probe import _mechanism
from kstore.kafka.security import probe_config

SECRET = "pa55-w0rd-SECRET"


def token() -> str:
    """A token provider given as MODULE:CALLABLE (tests.unit.kafka.test_kafka_settings:token)."""
    return "a.b.c"


class Provider(AbstractTokenProvider):  # type: ignore[misc]
    def token(self) -> str:
        return "from-a-class"


def test_the_options_settings_check_are_the_installed_kafka_pythons() -> None:
    """Settings checks Kafka options without importing kafka-python, from a copy of its lists:
    the copy is the installed kafka-python's, every name with the type of its default."""
    def kind(default: Any) -> type | None:
        if default is None:
            return None
        return type(default) if isinstance(default, (bool, int, float, str)) else object

    installed = {name: kind(v) for name, v in KafkaConsumer.DEFAULT_CONFIG.items()}
    assert installed == CONSUMER_OPTIONS
    assert sorted(SASL_MECHANISM_NAMES) == sorted(SASL_MECHANISMS)


@pytest.mark.parametrize(("options", "expected"), [
    ({"fetch_max_bytes": "1048576"}, {"fetch_max_bytes": 1048576}),
    ({"FETCH.MAX.BYTES": "7"}, {"fetch_max_bytes": 7}),
    ({"check_crcs": "false"}, {"check_crcs": False}),
    ({"isolation_level": "read_committed"}, {"isolation_level": "read_committed"}),
    ({"api_version": "3.7"}, {"api_version": (3, 7)}),
    ({"request_timeout_ms": 40_000}, {"request_timeout_ms": 40_000}),  # a Python value is kept as it is
])
def test_kafka_options_are_converted_to_the_options_type(options: dict[str, Any], expected: dict[str, Any]) -> None:
    assert check_kafka_options(options) == expected


@pytest.mark.parametrize(("name", "value", "said"), [
    ("fetch_max_bytez", "1", "unknown Kafka option 'fetch_max_bytez'"),
    ("group_id", "g", "is kstore's to set: the group is the processor's"),
    ("enable_auto_commit", "true", "offsets live in the database"),
    ("auto_offset_reset", "latest", "start_from"),
    ("value_deserializer", "x", "as bytes"),
    ("group_instance_id", "pod-1", "the group's leader never checks which database it writes to"),
    ("max_poll_records", "10", "a kstore setting of its own: use max_poll_records (KSTORE_MAX_POLL_RECORDS)"),
    ("sasl_plain_password", "x", "use sasl_password (KSTORE_SASL_PASSWORD)"),
    ("ssl_password", "x", "use ssl_key_password"),
    ("fetch_max_bytes", "lots", "fetch_max_bytes='lots' is not a valid int"),
    ("check_crcs", "maybe", "not a valid boolean"),
    ("isolation_level", "committed", "isolation_level must be read_committed or read_uncommitted"),
    ("metric_reporters", "x", "cannot be given as text"),
])
def test_bad_kafka_options_are_refused_with_the_reason(name: str, value: str, said: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Settings(kafka_client="kafka-python", kafka_options={name: value})
    assert said in str(raised.value)


def test_kafka_options_from_environment_and_overrides() -> None:
    s = Settings.from_env({"KSTORE_KAFKA_FETCH_MAX_BYTES": "2048", "KSTORE_KAFKA_CHECK_CRCS": "0"},
                          kafka_options={"check_crcs": "1"}, kafka_client="kafka-python")
    assert check_kafka_options(s.kafka_options) == {"fetch_max_bytes": 2048, "check_crcs": True}
    config = client_config(s)
    assert config["fetch_max_bytes"] == 2048 and config["check_crcs"] is True


@pytest.mark.parametrize(("settings", "said"), [
    ({"security_protocol": "TLS"}, "security_protocol must be one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
    ({"security_protocol": "SASL_SSL"}, "needs a sasl_mechanism"),
    ({"sasl_mechanism": "PLAIN"}, "needs security_protocol SASL_SSL or SASL_PLAINTEXT"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-1"}, "unknown sasl_mechanism 'SCRAM-SHA-1'"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u"}, "needs sasl_username and "
     "sasl_password"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}, "needs sasl_oauth_token_provider"),
    ({"ssl_cafile": "/ca.pem"}, "ssl_cafile is set but security_protocol is PLAINTEXT"),
    ({"security_protocol": "SSL", "ssl_keyfile": "/k.pem"}, "ssl_keyfile needs ssl_certfile"),
])
def test_security_settings_that_cannot_work_are_refused(settings: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Settings(**settings)
    assert said in str(raised.value)


def test_protocol_and_mechanism_are_case_insensitive() -> None:
    s = Settings(security_protocol="sasl_ssl", sasl_mechanism="scram-sha-512", sasl_username="u", sasl_password="p")
    assert (s.security_protocol, s.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")


def test_secrets_are_read_from_files_without_the_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "dsn").write_text(f"postgresql+psycopg2://u:{SECRET}@db/x\n")
    (tmp_path / "pw").write_text(SECRET + "\r\n")
    s = Settings.from_env({"KSTORE_DSN_FILE": str(tmp_path / "dsn"), "KSTORE_SECURITY_PROTOCOL": "SASL_SSL",
                           "KSTORE_SASL_MECHANISM": "PLAIN", "KSTORE_SASL_USERNAME": "u",
                           "KSTORE_SASL_PASSWORD_FILE": str(tmp_path / "pw")})
    assert s.dsn == f"postgresql+psycopg2://u:{SECRET}@db/x" and s.sasl_password == SECRET
    assert Settings.from_env({}, ssl_key_password_file=str(tmp_path / "pw")).ssl_key_password == SECRET
    assert s.secrets == [SECRET, SECRET]


def test_a_secret_and_its_file_together_are_refused(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(SECRET)
    with pytest.raises(ConfigurationError, match="given twice"):
        Settings.from_env({"KSTORE_SASL_PASSWORD": SECRET, "KSTORE_SASL_PASSWORD_FILE": str(tmp_path / "pw")})
    with pytest.raises(ConfigurationError, match="cannot read the secret file KSTORE_DSN_FILE=/no/such/file"):
        Settings.from_env({"KSTORE_DSN_FILE": "/no/such/file"})


def test_no_secret_in_the_settings_repr() -> None:
    s = Settings(dsn=f"postgresql+psycopg2://u:{SECRET}@db/x", security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                 sasl_username="u", sasl_password=SECRET, ssl_key_password=SECRET)
    assert SECRET not in repr(s) and SECRET not in str(s)


@pytest.mark.parametrize(("spec", "expected"), [
    ("tests.unit.kafka.test_kafka_settings:token", "a.b.c"),
    ("tests.unit.kafka.test_kafka_settings:Provider", "from-a-class"),
])
def test_token_providers_load_from_module_and_callable(spec: str, expected: str) -> None:
    provider = load_token_provider(spec)
    assert isinstance(provider, AbstractTokenProvider) and provider.token() == expected


@pytest.mark.parametrize(("spec", "expected"), [
    ("tests.unit.kafka.test_kafka_settings:token", "a.b.c"),
    ("tests.unit.kafka.test_kafka_settings:Provider", "from-a-class"),
])
def test_the_probe_logs_in_with_the_token_the_provider_gives(spec: str, expected: str) -> None:
    """The probe's OAUTHBEARER login sends the provider's token, from a function as from a class."""
    settings = Settings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                        sasl_oauth_token_provider=spec)
    mechanism = _mechanism("OAUTHBEARER", "localhost", settings, probe_config(settings))
    assert f"auth=Bearer {expected}".encode() in mechanism.auth_bytes()


@pytest.mark.parametrize(("spec", "said"), [
    ("no_colon", "must be MODULE:CALLABLE"),
    ("tests.no_such_module:f", "cannot import token provider module"),
    ("tests.unit.kafka.test_kafka_settings:nothing", "has no 'nothing'"),
    ("tests.unit.kafka.test_kafka_settings:SECRET", "neither a function nor a token provider"),
])
def test_bad_token_providers_are_named(spec: str, said: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load_token_provider(spec)
    assert said in str(raised.value)


def test_tls_settings_become_one_context_with_hostname_checks_on(tmp_path: Path) -> None:
    config = client_config(Settings(security_protocol="SSL"))
    ctx = config["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert not client_config(Settings(security_protocol="SSL", ssl_check_hostname=False))["ssl_context"].check_hostname
    assert "ssl_context" not in client_config(Settings())


def test_unreadable_tls_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot load ssl_cafile /no/ca.pem: No such file"):
        client_config(Settings(security_protocol="SSL", ssl_cafile="/no/ca.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigurationError, match=r"cannot load the client certificate .*junk.pem"):
        client_config(Settings(security_protocol="SSL", ssl_certfile=str(tmp_path / "junk.pem")))
