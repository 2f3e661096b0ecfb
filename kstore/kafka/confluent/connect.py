"""How the confluent-kafka backend connects: kstore's settings as librdkafka properties, and clear errors.

The same settings as kafka-python's clients, under librdkafka's
names: ``security_protocol`` -> ``security.protocol``, ``sasl_mechanism`` -> ``sasl.mechanisms``,
``sasl_username``/``sasl_password`` -> ``sasl.username``/``sasl.password``, ``ssl_cafile`` ->
``ssl.ca.location``, ``ssl_certfile``/``ssl_keyfile``/``ssl_key_password`` ->
``ssl.certificate.location``/``ssl.key.location``/``ssl.key.password``, ``ssl_check_hostname``
-> ``ssl.endpoint.identification.algorithm`` (``https`` or ``none``), and
``sasl_oauth_token_provider`` -> an ``oauth_cb`` that asks the provider for each token.

Before the consumer is made, the TLS files are loaded once by Python's ssl module (so a file
that cannot be read, a wrong key password or an expired certificate is one clear line), and
the broker probe (:mod:`kstore.kafka.probe`) looks at the first broker with the very same
settings as for kafka-python: librdkafka, like kafka-python, only retries such mistakes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.options import DEFAULT_ISOLATION_LEVEL, shown_options
from kstore.kafka.probe import probe
from kstore.kafka.security import load_token_provider, probe_config

if TYPE_CHECKING:
    from kstore.settings import Settings

log = logging.getLogger(__name__)

#: How long a token from ``sasl_oauth_token_provider`` is used before librdkafka asks again
#: (it refreshes at 80% of this): the provider's tokens carry no lifetime kstore could read.
OAUTH_TOKEN_LIFETIME_S = 60.0


def librdkafka_config(settings: Settings) -> dict[str, Any]:
    """Brokers, security and the user's librdkafka options (already checked by Settings)."""
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        "security.protocol": settings.security_protocol.lower(),
        "socket.connection.setup.timeout.ms": int(settings.connect_timeout_s * 1000),
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        # The system's CAs when none is given (librdkafka's "probe" looks in the usual places).
        config["ssl.ca.location"] = settings.ssl_cafile or "probe"
        if settings.ssl_certfile:
            config["ssl.certificate.location"] = settings.ssl_certfile
            # A PEM file may hold the key after the certificate (as kafka-python accepts it).
            config["ssl.key.location"] = settings.ssl_keyfile or settings.ssl_certfile
        if settings.ssl_key_password is not None:
            config["ssl.key.password"] = settings.ssl_key_password
        config["ssl.endpoint.identification.algorithm"] = "https" if settings.ssl_check_hostname else "none"
    if settings.sasl_mechanism:
        config["sasl.mechanisms"] = settings.sasl_mechanism
        if settings.sasl_username is not None:
            config["sasl.username"] = settings.sasl_username
        if settings.sasl_password is not None:
            config["sasl.password"] = settings.sasl_password
        if settings.sasl_oauth_token_provider:
            config["oauth_cb"] = _oauth_callback(load_token_provider(settings.sasl_oauth_token_provider).token)
    config.update(settings.kafka_options)
    config.setdefault("isolation.level", DEFAULT_ISOLATION_LEVEL)
    return config


def _oauth_callback(token: Callable[[], str]) -> Callable[[str], tuple[str, float]]:
    def oauth_cb(_config: str) -> tuple[str, float]:
        return token(), time.time() + OAUTH_TOKEN_LIFETIME_S
    return oauth_cb


def open_rd_consumer(settings: Settings, **kstore_config: Any) -> Consumer:
    """A confluent-kafka Consumer with kstore's own properties (``kstore_config``) over the user's.

    The TLS files are checked and the first broker probed first (see the module's docstring);
    librdkafka checks the properties' values here, and refuses a wrong one in one line.
    """
    config = checked_config(settings)
    config.update(kstore_config)
    if settings.kafka_options:
        shown = sorted(shown_options(settings.kafka_options).items())
        log.info("librdkafka options: %s", ", ".join(f"{k}={v!r}" for k, v in shown))
    try:
        return Consumer(config)
    except KafkaException as exc:
        raise ConfigurationError(f"Kafka client configuration: {describe(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"Kafka client configuration: {exc}") from None


def client_config(settings: Settings) -> dict[str, Any]:
    """librdkafka's properties for kstore's clients besides the worker's consumer (the relay's producer,
    the operator's tools): the user's ``kafka_options`` only where they are librdkafka's
    (``kafka_client = "confluent"``), and none that is the consumer's alone."""
    if settings.kafka_client != "confluent" and settings.kafka_options:
        settings = dataclasses.replace(settings, kafka_options={})
    config = librdkafka_config(settings)
    config.pop("isolation.level", None)
    return config


def checked_config(settings: Settings, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config`` (:func:`librdkafka_config` if None), once the TLS files and the token provider have
    loaded (one clear line each) and the first broker has been probed (see the module's docstring)."""
    probe(settings, probe_config(settings))
    return dict(config) if config is not None else librdkafka_config(settings)


def describe(exc: BaseException) -> str:
    """librdkafka's own sentence for an error, not the KafkaError{...} repr."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(error, KafkaError):
        return str(error.str())
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def broker_error(settings: Settings, what: str, exc: BaseException) -> BrokerError:
    """A one-line error for a failed request to the brokers, naming authentication when that is why."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    where = settings.bootstrap_servers
    if isinstance(error, KafkaError) and error.code() == KafkaError._AUTHENTICATION:
        who = f" as user {settings.sasl_username!r}" if settings.sasl_username else ""
        return BrokerError(f"Kafka at {where} refused SASL {settings.sasl_mechanism} authentication{who}: "
                           f"{describe(exc)}")
    if isinstance(error, KafkaError) and error.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                                                          KafkaError._ALL_BROKERS_DOWN):
        # Worded as kafka-python's probe words it (kstore.kafka.kafkapython.connect): one message per
        # failure, whichever client.
        return BrokerError(f"cannot reach Kafka at {where} within {settings.connect_timeout_s:g}s to {what} "
                           f"({describe(exc)}): check --bootstrap-servers and security_protocol "
                           f"({settings.security_protocol})")
    return BrokerError(f"cannot {what} at {where}: {describe(exc)}")
