"""Which Kafka client options kstore accepts, and the security settings that go together: pure checks.

:class:`~kstore.settings.Settings` checks its ``kafka_options`` and security fields here when it
is made, so a typo or a combination that cannot work is a clear error before anything connects.
Nothing here imports kafka-python or opens a connection: the Kafka side (:mod:`kstore.kafka`)
builds the clients from the checked settings. Which options hold a secret is known here too
(:func:`shown_options`), so that none is ever shown.

Imports only :mod:`kstore.errors` and :mod:`kstore.kafka.rdkafkaoptions`: :mod:`kstore.settings`
imports this, below the rest of the Kafka side (pyproject.toml's import contracts hold it).

:data:`CONSUMER_OPTIONS` and :data:`SASL_MECHANISM_NAMES` are what kafka-python itself knows
(``KafkaConsumer.DEFAULT_CONFIG`` and ``kafka.net.sasl.SASL_MECHANISMS``), written out; a test
holds them equal to the installed kafka-python's (tests/unit/kafka/test_kafka_settings.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, cast

from kstore.errors import ConfigurationError
from kstore.kafka.rdkafkaoptions import check_librdkafka_options, refuse_reserved

#: What a secret is shown as.
MASK = "***"

#: The Kafka clients kstore's worker can consume with: kafka-python (the default) or
#: confluent-kafka (librdkafka), whose ``kafka_options`` are librdkafka's property names.
KAFKA_CLIENTS = ("kafka-python", "confluent")

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
#: The SASL mechanisms kafka-python implements (its ``kafka.net.sasl.SASL_MECHANISMS``).
SASL_MECHANISM_NAMES = ("AWS_MSK_IAM", "GSSAPI", "OAUTHBEARER", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
#: The SASL mechanisms librdkafka implements (the confluent backend).
LIBRDKAFKA_SASL_MECHANISMS = ("GSSAPI", "OAUTHBEARER", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_USER_PASSWORD_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

#: kafka-python options that have a kstore setting of their own: name -> that setting.
_OWN_SETTING = {
    "bootstrap_servers": "bootstrap_servers",
    "client_id": "client_id",
    "bootstrap_timeout_ms": "connect_timeout_s",
    "max_poll_records": "max_poll_records",
    "session_timeout_ms": "session_timeout_ms",
    "heartbeat_interval_ms": "heartbeat_interval_ms",
    "max_poll_interval_ms": "max_poll_interval_ms",
    "security_protocol": "security_protocol",
    "sasl_mechanism": "sasl_mechanism",
    "sasl_plain_username": "sasl_username",
    "sasl_plain_password": "sasl_password",
    "sasl_oauth_token_provider": "sasl_oauth_token_provider",
    "ssl_cafile": "ssl_cafile",
    "ssl_certfile": "ssl_certfile",
    "ssl_keyfile": "ssl_keyfile",
    "ssl_password": "ssl_key_password",
    "ssl_check_hostname": "ssl_check_hostname",
}
#: kafka-python options kstore must control itself: name -> why.
_KSTORE_CONTROLS = {
    "group_id": "the group is the processor's (--group)",
    "enable_auto_commit": "offsets live in the database, never in Kafka",
    "auto_commit_interval_ms": "offsets live in the database, never in Kafka",
    "default_offset_commit_callback": "offsets live in the database, never in Kafka",
    "auto_offset_reset": "a partition with no stored offset starts at start_from",
    "allow_auto_create_topics": "kstore never creates topics",
    "consumer_timeout_ms": "the worker polls until it is stopped",
    "key_deserializer": "messages reach the processor as bytes",
    "value_deserializer": "messages reach the processor as bytes",
    "partition_assignment_strategy": "kstore's rebalance handling is built for the eager protocol",
    "kafka_client": "kstore relies on kafka-python's own network client",
    "group_instance_id": "static membership lets a restarted worker take back its partitions without a "
                         "rebalance, so the group's leader never checks which database it writes to "
                         "(one pipeline, one database)",
}
#: Options whose default is None: the type their text form converts to.
_TEXT_TYPES: dict[str, Callable[[str], Any]] = {
    "api_version": lambda raw: tuple(int(part) for part in raw.split(".")),
    "proxy_url": str,
    "socks5_proxy": str,
    "receive_buffer_bytes": int,
    "send_buffer_bytes": int,
    "sasl_kerberos_domain_name": str,
    "sasl_kerberos_name": str,
    "ssl_crlfile": str,
    "ssl_ciphers": str,
}
#: Every consumer kstore makes reads only committed records of upstream transactions (records of
#: aborted ones are skipped; the log end it sees is the last stable offset). ``isolation_level``
#: among the Kafka options overrides it: ``read_uncommitted`` also delivers aborted records.
DEFAULT_ISOLATION_LEVEL = "read_committed"
ISOLATION_LEVELS = ("read_committed", "read_uncommitted")

#: kafka-python's consumer options (``KafkaConsumer.DEFAULT_CONFIG``): name -> the type of its
#: default, which a value given as text converts to; None: no default (see ``_TEXT_TYPES``);
#: ``object``: a value that cannot be written as text (a list, a class, a function).
CONSUMER_OPTIONS: dict[str, type | None] = {
    "bootstrap_servers": str,
    "client_id": str,
    "client_rack": str,
    "group_id": None,
    "group_instance_id": None,
    "key_deserializer": None,
    "value_deserializer": None,
    "enable_incremental_fetch_sessions": bool,
    "fetch_max_wait_ms": int,
    "fetch_min_bytes": int,
    "fetch_max_bytes": int,
    "max_partition_fetch_bytes": int,
    "request_timeout_ms": int,
    "retry_backoff_ms": int,
    "reconnect_backoff_ms": int,
    "reconnect_backoff_max_ms": int,
    "max_in_flight_requests_per_connection": int,
    "auto_offset_reset": str,
    "enable_auto_commit": bool,
    "auto_commit_interval_ms": int,
    "default_offset_commit_callback": object,
    "check_crcs": bool,
    "isolation_level": str,
    "allow_auto_create_topics": bool,
    "metadata_max_age_ms": int,
    "client_dns_lookup": str,
    "partition_assignment_strategy": object,
    "max_poll_records": int,
    "max_poll_interval_ms": int,
    "session_timeout_ms": int,
    "heartbeat_interval_ms": int,
    "receive_buffer_bytes": None,
    "send_buffer_bytes": None,
    "receive_message_max_bytes": int,
    "socket_options": object,
    "consumer_timeout_ms": float,
    "security_protocol": str,
    "ssl_context": None,
    "ssl_check_hostname": bool,
    "ssl_cafile": None,
    "ssl_certfile": None,
    "ssl_keyfile": None,
    "ssl_crlfile": None,
    "ssl_password": None,
    "ssl_ciphers": None,
    "api_version": None,
    "bootstrap_timeout_ms": int,
    "connections_max_idle_ms": int,
    "metric_reporters": object,
    "metrics_enabled": bool,
    "metrics_num_samples": int,
    "metrics_sample_window_ms": int,
    "metric_group_prefix": str,
    "selector": object,
    "exclude_internal_topics": bool,
    "sasl_mechanism": None,
    "sasl_plain_username": None,
    "sasl_plain_password": None,
    "sasl_kerberos_name": None,
    "sasl_kerberos_service_name": str,
    "sasl_kerberos_domain_name": None,
    "sasl_oauth_token_provider": None,
    "proxy_url": None,
    "socks5_proxy": None,
    "kafka_client": object,
}


#: Kafka option names (either client's spelling) whose value is a secret.
_SECRET_OPTION = re.compile(r"(?i)password|passwd|secret|passphrase|private[._]key|key[._]pem")


def is_secret_option(name: str) -> bool:
    """Whether a Kafka option of this name holds a secret (``sasl.password``, ``ssl.key.pem``, ...)."""
    return _SECRET_OPTION.search(name) is not None


def shown_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Kafka options as they may be shown: the value of each secret one is :data:`MASK`."""
    return {name: MASK if is_secret_option(name) else value for name, value in options.items()}


def check_kafka_options(options: Mapping[str, Any], client: str = "kafka-python") -> dict[str, Any]:
    """Validate ``kafka_options`` by name and convert text values to the option's type.

    Raises :class:`ConfigurationError` for an unknown name, one kstore controls or has
    its own setting for, or text that does not parse. With ``client="confluent"`` the names
    are librdkafka's (:func:`kstore.kafka.rdkafkaoptions.check_librdkafka_options`).
    """
    if client not in KAFKA_CLIENTS:
        raise ConfigurationError(f"kafka_client must be {' or '.join(KAFKA_CLIENTS)}, got {client!r}")
    if client == "confluent":
        return check_librdkafka_options(options)
    known = CONSUMER_OPTIONS
    checked: dict[str, Any] = {}
    for raw_name, value in options.items():
        name = raw_name.strip().lower().replace(".", "_").replace("-", "_")
        refuse_reserved(raw_name, name, _OWN_SETTING, _KSTORE_CONTROLS)
        if name not in known:
            raise ConfigurationError(f"unknown Kafka option {raw_name!r} (not a kafka-python consumer option)")
        checked[name] = _from_text(name, value, known[name]) if isinstance(value, str) else value
    level = checked.get("isolation_level")
    if level is not None and level not in ISOLATION_LEVELS:
        raise ConfigurationError(f"Kafka option isolation_level must be {' or '.join(ISOLATION_LEVELS)}, got {level!r}")
    return checked


def _from_text(name: str, raw: str, kind: type | None) -> Any:
    if kind is bool:
        convert: Callable[[str], Any] = _parse_bool
    elif kind in (int, float, str):
        convert = cast(Callable[[str], Any], kind)
    elif kind is None and name in _TEXT_TYPES:
        convert = _TEXT_TYPES[name]
    else:
        raise ConfigurationError(
            f"Kafka option {name!r} cannot be given as text: set it in Settings(kafka_options=...) from Python"
        )
    try:
        return convert(raw.strip())
    except ValueError:
        raise ConfigurationError(f"Kafka option {name}={raw!r} is not a valid {convert.__name__}") from None


def _parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_parse_bool.__name__ = "boolean"


def _check_mechanism(mechanism: str, client: str) -> None:
    if mechanism not in SASL_MECHANISM_NAMES:
        raise ConfigurationError(f"unknown sasl_mechanism {mechanism!r}: kstore supports "
                                 f"{', '.join(SASL_MECHANISM_NAMES)}")
    if client == "confluent" and mechanism not in LIBRDKAFKA_SASL_MECHANISMS:
        raise ConfigurationError(f"sasl_mechanism {mechanism} is kafka-python's only: with kafka_client "
                                 f"confluent use {', '.join(LIBRDKAFKA_SASL_MECHANISMS)}")


def check_security(settings: Any) -> None:
    """The security settings agree with each other (no file or network access here)."""
    protocol, mechanism = settings.security_protocol, settings.sasl_mechanism
    if protocol not in SECURITY_PROTOCOLS:
        raise ConfigurationError(f"security_protocol must be one of {', '.join(SECURITY_PROTOCOLS)}, got {protocol!r}")
    sasl = protocol.startswith("SASL_")
    if sasl and mechanism is None:
        raise ConfigurationError(f"security_protocol {protocol} needs a sasl_mechanism "
                                 f"({', '.join(SASL_MECHANISM_NAMES)})")
    if mechanism is not None:
        if not sasl:
            raise ConfigurationError(f"sasl_mechanism {mechanism} needs security_protocol SASL_SSL or SASL_PLAINTEXT, "
                                     f"not {protocol}")
        _check_mechanism(mechanism, getattr(settings, "kafka_client", "kafka-python"))
        if mechanism in _USER_PASSWORD_MECHANISMS and (not settings.sasl_username or settings.sasl_password is None):
            raise ConfigurationError(f"sasl_mechanism {mechanism} needs sasl_username and sasl_password "
                                     "(KSTORE_SASL_PASSWORD_FILE reads the password from a file)")
        if mechanism == "OAUTHBEARER" and not settings.sasl_oauth_token_provider:
            raise ConfigurationError("sasl_mechanism OAUTHBEARER needs sasl_oauth_token_provider (MODULE:CALLABLE)")
    tls_files = [name for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(settings, name)]
    if tls_files and protocol not in ("SSL", "SASL_SSL"):
        raise ConfigurationError(f"{tls_files[0]} is set but security_protocol is {protocol}: TLS is off "
                                 "(use SSL or SASL_SSL)")
    if settings.ssl_keyfile and not settings.ssl_certfile:
        raise ConfigurationError("ssl_keyfile needs ssl_certfile (the client certificate)")
