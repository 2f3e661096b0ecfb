"""Settings (kstore.settings): read from the environment, checked with a clear error, the DSN shown
without its password and no secret in its repr."""

from __future__ import annotations

import pytest

from kstore import ConfigurationError, Settings


def test_settings_from_env_types_and_overrides() -> None:
    s = Settings.from_env({"KSTORE_MAX_BATCH_SIZE": "7", "KSTORE_TOPICS": "a, b", "KSTORE_STRICT_RESETS": "yes",
                           "KSTORE_TEST_WHATEVER": "ignored", "PATH": "/bin"}, group="g", dsn=None)
    assert (s.max_batch_size, s.topics, s.strict_resets, s.group) == (7, ("a", "b"), True, "g")
    assert s.dsn == "sqlite:///kstore.db"


@pytest.mark.parametrize(("env", "message"), [
    ({"KSTORE_MAX_BATCH": "5"}, "unknown setting in environment: KSTORE_MAX_BATCH"),
    ({"KSTORE_MAX_BATCH_SIZE": "x"}, "KSTORE_MAX_BATCH_SIZE='x' is not a valid int"),
    ({"KSTORE_MAX_BATCH_SIZE": "0"}, "max_batch_size must be positive"),
    ({"KSTORE_START_FROM": "2026-01-01T00:00:00"}, "needs a timezone"),
    ({"KSTORE_ON_ERROR": "ignore"}, "on_error must be stop or dead_letter"),
])
def test_bad_settings_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        Settings.from_env(env)


def test_safe_dsn_masks_the_password() -> None:
    s = Settings(dsn="postgresql+psycopg2://app:hunter2@db/app")
    assert "hunter2" not in s.safe_dsn and "app:***@db" in s.safe_dsn


def test_a_postgres_scheme_dsn_is_understood() -> None:
    assert Settings(dsn="postgres://u:pw@db:5432/app").dsn == "postgresql://u:pw@db:5432/app"
    assert Settings(dsn="postgres+psycopg2://u@db/app").dsn == "postgresql+psycopg2://u@db/app"


def test_the_console_believes_no_proxy_and_sets_no_forced_secure_cookie_by_default() -> None:
    s = Settings.from_env({})
    assert (s.console_trusted_proxies, s.console_secure_cookie) == ((), False)


def test_trusted_proxies_and_the_secure_cookie_come_from_the_environment() -> None:
    s = Settings.from_env({"KSTORE_CONSOLE_TRUSTED_PROXIES": "127.0.0.1, 10.0.0.0/8,::1,fd00::/8",
                           "KSTORE_CONSOLE_SECURE_COOKIE": "true"})
    assert s.console_trusted_proxies == ("127.0.0.1", "10.0.0.0/8", "::1", "fd00::/8")
    assert s.console_secure_cookie is True


def test_trusted_proxies_given_as_an_argument_win_over_the_environment() -> None:
    s = Settings.from_env({"KSTORE_CONSOLE_TRUSTED_PROXIES": "10.0.0.1"}, console_trusted_proxies=("192.168.0.0/16",))
    assert s.console_trusted_proxies == ("192.168.0.0/16",)
    assert Settings(console_trusted_proxies="10.0.0.1,10.0.0.2").console_trusted_proxies == ("10.0.0.1", "10.0.0.2")


@pytest.mark.parametrize(("value", "reason"), [
    ("not-an-ip", ""),
    ("proxy.example.com", ""),
    ("*", ""),
    ("10.0.0.1/8", "has host bits set"),
    ("10.0.0.0/33", ""),
    ("300.1.2.3", ""),
])
def test_a_trusted_proxy_that_is_not_an_address_or_network_is_a_one_line_error(value: str, reason: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Settings.from_env({"KSTORE_CONSOLE_TRUSTED_PROXIES": f"127.0.0.1,{value}"})
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"console_trusted_proxies: {value!r} is not an IP address or network"), message
    assert reason in message


def test_a_secure_cookie_value_that_is_not_a_bool_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match="KSTORE_CONSOLE_SECURE_COOKIE='maybe' is not a valid bool"):
        Settings.from_env({"KSTORE_CONSOLE_SECURE_COOKIE": "maybe"})


def test_settings_repr_holds_no_secret() -> None:
    settings = Settings(dsn="postgresql://u:dsn-secret@h/db", security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                        sasl_username="u", sasl_password="sasl-secret", ssl_key_password="key-secret",
                        kafka_client="confluent", kafka_options={"ssl.keystore.password": "store-secret"})
    text = repr(settings)
    assert "secret" not in text.replace("'***'", ""), text
    assert "'ssl.keystore.password': '***'" in text


def test_settings_refuse_a_static_member_id() -> None:
    """Static membership (``group.instance.id``) is refused by Settings itself; the worker's one line
    for it: tests/integration/worker/test_static_membership.py."""
    with pytest.raises(ConfigurationError, match="the group's leader never checks which database it writes to"):
        Settings(kafka_options={"group.instance.id": "pod-1"})
