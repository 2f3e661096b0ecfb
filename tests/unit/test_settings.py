"""Settings (kstore.settings): read from the environment, checked with a clear error, the DSN shown
without its password."""

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
