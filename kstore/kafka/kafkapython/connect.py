"""How kstore connects to Kafka: security settings, any other client option, and clear errors.

Every Kafka client kstore makes (the worker's consumer, and the consumer and admin
client of ``kstore offsets``) is built by :func:`open_consumer` / :func:`open_admin`
from one :class:`~kstore.settings.Settings`, so TLS, SASL and extra options apply
everywhere alike.

TLS: kstore builds the :class:`ssl.SSLContext` itself (:mod:`kstore.kafka.security`) and hands it
to kafka-python, so a file that cannot be read or a wrong key password is a clear error before
anything connects, and the probe (:mod:`kstore.kafka.probe`) checks the brokers with the very same
context.

Other kafka-python options are accepted by name (``kafka_options``); which ones, and the
security settings that go together, :class:`~kstore.settings.Settings` has already checked
(:mod:`kstore.kafka.options`, which needs no kafka-python).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kafka import KafkaAdminClient, KafkaConsumer
from kafka.errors import (
    KafkaConfigurationError,
    KafkaError,
    KafkaTimeoutError,
    SaslAuthenticationFailedError,
    UnsupportedSaslMechanismError,
)
from kafka.net.sasl.oauth import AbstractTokenProvider

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka import security
from kstore.kafka.options import DEFAULT_ISOLATION_LEVEL, shown_options
from kstore.kafka.probe import probe
from kstore.kafka.security import TokenProvider, ssl_context

if TYPE_CHECKING:
    from kstore.settings import Settings

log = logging.getLogger(__name__)

class _TokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """kafka-python's face of a token provider that is not its own kind (a function, say)."""

    def __init__(self, provider: TokenProvider) -> None:
        super().__init__()
        self._provider = provider

    def token(self) -> str:
        return self._provider.token()


def load_token_provider(spec: str) -> AbstractTokenProvider:
    """``sasl_oauth_token_provider`` (:func:`kstore.kafka.security.load_token_provider`) as kafka-python
    takes it: an AbstractTokenProvider."""
    provider = security.load_token_provider(spec)
    return provider if isinstance(provider, AbstractTokenProvider) else _TokenProvider(provider)


def client_config(settings: Settings) -> dict[str, Any]:
    """What every kafka-python client of kstore is given: brokers, security, extra options
    (``settings.kafka_options``, already checked and converted by Settings). With
    ``kafka_client="confluent"`` the options are librdkafka's, for the worker's consumer only:
    kstore's kafka-python clients (relay, ``kstore offsets``, the probe) get none of them."""
    options = settings.kafka_options if getattr(settings, "kafka_client", "kafka-python") == "kafka-python" else {}
    config: dict[str, Any] = {
        k: v for k, v in options.items() if k not in security.SSL_CONTEXT_OPTIONS and k != "ssl_context"
    }
    config.update(
        bootstrap_servers=settings.bootstrap_servers.split(","),
        bootstrap_timeout_ms=int(settings.connect_timeout_s * 1000),
        security_protocol=settings.security_protocol,
    )
    context = ssl_context(settings, options)
    if context is not None:
        config["ssl_context"] = context
    if settings.sasl_mechanism:
        config["sasl_mechanism"] = settings.sasl_mechanism
        if settings.sasl_username is not None:
            config["sasl_plain_username"] = settings.sasl_username
        if settings.sasl_password is not None:
            config["sasl_plain_password"] = settings.sasl_password
        if settings.sasl_oauth_token_provider:
            config["sasl_oauth_token_provider"] = load_token_provider(settings.sasl_oauth_token_provider)
    return config


def open_consumer(settings: Settings, **kstore_config: Any) -> Any:
    """A KafkaConsumer with kstore's own settings (``kstore_config``) over the user's options."""
    config = client_config(settings)
    config.setdefault("isolation_level", DEFAULT_ISOLATION_LEVEL)
    config.update(kstore_config)
    if settings.kafka_options:
        shown = sorted(shown_options(settings.kafka_options).items())
        log.info("Kafka options: %s", ", ".join(f"{k}={v!r}" for k, v in shown))
    return _open(settings, config, lambda: KafkaConsumer(**config))


def open_admin(settings: Settings) -> Any:
    """A KafkaAdminClient given the options an admin client knows (the consumer-only ones dropped)."""
    config = {k: v for k, v in client_config(settings).items() if k in KafkaAdminClient.DEFAULT_CONFIG}
    return _open(settings, config, lambda: KafkaAdminClient(**config))


def _open(settings: Settings, config: Mapping[str, Any], make: Callable[[], Any]) -> Any:
    probe(settings, config)
    where = settings.bootstrap_servers
    try:
        return _no_auto_create(make(), config)
    except SaslAuthenticationFailedError as exc:
        raise BrokerError(f"Kafka at {where} refused SASL {settings.sasl_mechanism} authentication"
                          f"{_as_user(settings)}: {_first_line(exc)}") from None
    except UnsupportedSaslMechanismError as exc:
        raise BrokerError(f"Kafka at {where} does not enable SASL {settings.sasl_mechanism}: {exc}") from None
    except KafkaConfigurationError as exc:
        raise ConfigurationError(f"Kafka client configuration: {exc}") from None
    except KafkaTimeoutError:
        raise BrokerError(
            f"cannot reach Kafka at {where} within {settings.connect_timeout_s:g}s: check --bootstrap-servers "
            f"and security_protocol ({settings.security_protocol})"
        ) from None
    except KafkaError as exc:
        raise BrokerError(f"Kafka at {where} refused the client: {_first_line(exc)}") from None


def _no_auto_create(client: Any, config: Mapping[str, Any]) -> Any:
    """The client, its metadata requests asking the brokers never to create a topic when
    ``allow_auto_create_topics=False``. kafka-python 3.0 keeps that option in the consumer's and the
    producer's own config but builds the metadata its requests come from without it (so they ask
    for creation, and a broker with ``auto.create.topics.enable`` recreates a deleted topic with its
    defaults): it is set there too."""
    if config.get("allow_auto_create_topics", True):
        return client
    cluster = getattr(client, "_metadata", None) or getattr(client, "_cluster", None)
    options = getattr(cluster, "config", None)
    if isinstance(options, dict) and "allow_auto_create_topics" in options:
        options["allow_auto_create_topics"] = False
    return client


def _as_user(settings: Settings) -> str:
    return f" as user {settings.sasl_username!r}" if settings.sasl_username else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
