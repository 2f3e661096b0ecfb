"""How kstore connects to Kafka: security settings, any other client option, and clear errors.

Every Kafka client kstore makes (the worker's consumer, and the consumer and admin
client of ``kstore offsets``) is built by :func:`open_consumer` / :func:`open_admin`
from one :class:`~kstore.settings.Settings`, so TLS, SASL and extra options apply
everywhere alike.

TLS: kstore builds the :class:`ssl.SSLContext` itself (from ``ssl_cafile``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_key_password``, ``ssl_check_hostname`` and the
``ssl_crlfile``/``ssl_ciphers`` options) and hands it to kafka-python, so a file that
cannot be read or a wrong key password is a clear error before anything connects, and
the probe (:mod:`kstore.kafka.probe`) checks the brokers with the very same context.

Other kafka-python options are accepted by name (``kafka_options``); which ones, and the
security settings that go together, :class:`~kstore.settings.Settings` has already checked
(:mod:`kstore.kafkaoptions`, which needs no kafka-python).
"""

from __future__ import annotations

import importlib
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

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
from kstore.kafka.probe import probe
from kstore.kafkaoptions import DEFAULT_ISOLATION_LEVEL
from kstore.masking import shown_options

log = logging.getLogger(__name__)

#: Options kstore folds into the SSL context it builds (kafka-python ignores them once given a context).
_SSL_CONTEXT_OPTIONS = ("ssl_crlfile", "ssl_ciphers")


def ssl_context(settings: Any, options: Mapping[str, Any]) -> ssl.SSLContext | None:
    """The TLS context every Kafka connection uses, or None without TLS; a user's own
    ``ssl_context`` option is used as it is."""
    if settings.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    given = options.get("ssl_context")
    if given is not None:
        if not isinstance(given, ssl.SSLContext):
            raise ConfigurationError("Kafka option ssl_context must be an ssl.SSLContext")
        return given
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = settings.ssl_check_hostname
    _load_trust(ctx, settings.ssl_cafile, options.get("ssl_crlfile"))
    if settings.ssl_certfile:
        _load_client_certificate(ctx, settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_key_password)
    if options.get("ssl_ciphers"):
        try:
            ctx.set_ciphers(options["ssl_ciphers"])
        except ssl.SSLError as exc:
            raise ConfigurationError(f"invalid ssl_ciphers: {_reason(exc)}") from None
    return ctx


def _load_trust(ctx: ssl.SSLContext, cafile: str | None, crlfile: str | None) -> None:
    for name, path in (("ssl_cafile", cafile), ("ssl_crlfile", crlfile)):
        if not path:
            continue
        try:
            ctx.load_verify_locations(cafile=path)  # a PEM file of CRLs loads the same way
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"cannot load {name} {path}: {_reason(exc)}") from None
    if not cafile:
        ctx.load_default_certs()
    if crlfile:
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF


def _load_client_certificate(ctx: ssl.SSLContext, certfile: str, keyfile: str | None, password: str | None) -> None:
    files = certfile + (f" and {keyfile}" if keyfile else "")
    try:
        ctx.load_cert_chain(certfile, keyfile or None, password=password)
    except (OSError, ssl.SSLError) as exc:
        hint = " (wrong or missing ssl_key_password?)" if isinstance(exc, ssl.SSLError) else ""
        raise ConfigurationError(f"cannot load the client certificate {files}: {_reason(exc)}{hint}") from None
    expires = _not_after(certfile)
    if expires is not None and expires < time.time():
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
        raise ConfigurationError(f"the client certificate {certfile} expired on {when}: brokers will refuse it")


def _not_after(certfile: str) -> float | None:
    """When a PEM certificate expires, by the ssl module's own decoder (None if it cannot tell)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return float(ssl.cert_time_to_seconds(decode(certfile)["notAfter"]))
    except (OSError, ValueError, KeyError, ssl.SSLError):
        return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ssl.SSLError):
        return exc.strerror
    reason = getattr(exc, "reason", None)
    return str(reason or exc)


class _CallableTokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """Wraps a plain function returning a token string, called at each authentication."""

    def __init__(self, fn: Callable[[], str]) -> None:
        super().__init__()
        self._fn = fn

    def token(self) -> str:
        return self._fn()


def load_token_provider(spec: str) -> AbstractTokenProvider:
    """``MODULE:CALLABLE``: an AbstractTokenProvider subclass (instantiated without arguments)
    or instance, or a function returning the current token string."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"sasl_oauth_token_provider must be MODULE:CALLABLE, got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import token provider module {module_name!r}: {exc}") from None
    except AttributeError:
        raise ConfigurationError(f"module {module_name!r} has no {attr!r} (sasl_oauth_token_provider)") from None
    if isinstance(target, type) and issubclass(target, AbstractTokenProvider):
        return target()
    if isinstance(target, AbstractTokenProvider):
        return target
    if callable(target):
        return _CallableTokenProvider(target)
    raise ConfigurationError(f"sasl_oauth_token_provider {spec!r} is neither a function nor a token provider")


def client_config(settings: Any) -> dict[str, Any]:
    """What every kafka-python client of kstore is given: brokers, security, extra options
    (``settings.kafka_options``, already checked and converted by Settings). With
    ``kafka_client="confluent"`` the options are librdkafka's, for the worker's consumer only:
    kstore's kafka-python clients (relay, ``kstore offsets``, the probe) get none of them."""
    options = settings.kafka_options if getattr(settings, "kafka_client", "kafka-python") == "kafka-python" else {}
    config: dict[str, Any] = {
        k: v for k, v in options.items() if k not in _SSL_CONTEXT_OPTIONS and k != "ssl_context"
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


def open_consumer(settings: Any, **kstore_config: Any) -> Any:
    """A KafkaConsumer with kstore's own settings (``kstore_config``) over the user's options."""
    config = client_config(settings)
    config.setdefault("isolation_level", DEFAULT_ISOLATION_LEVEL)
    config.update(kstore_config)
    if settings.kafka_options:
        shown = sorted(shown_options(settings.kafka_options).items())
        log.info("Kafka options: %s", ", ".join(f"{k}={v!r}" for k, v in shown))
    return _open(settings, config, lambda: KafkaConsumer(**config))


def open_admin(settings: Any) -> Any:
    """A KafkaAdminClient given the options an admin client knows (the consumer-only ones dropped)."""
    config = {k: v for k, v in client_config(settings).items() if k in KafkaAdminClient.DEFAULT_CONFIG}
    return _open(settings, config, lambda: KafkaAdminClient(**config))


def _open(settings: Any, config: Mapping[str, Any], make: Callable[[], Any]) -> Any:
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


def _as_user(settings: Any) -> str:
    return f" as user {settings.sasl_username!r}" if settings.sasl_username else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
