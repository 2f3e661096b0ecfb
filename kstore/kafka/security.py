"""How kstore secures a Kafka connection, on either client: the TLS context, and a SASL/OAUTHBEARER
token provider loaded from ``sasl_oauth_token_provider``. Needs no client library.

kstore builds the :class:`ssl.SSLContext` itself (from ``ssl_cafile``, ``ssl_certfile``,
``ssl_keyfile``, ``ssl_key_password``, ``ssl_check_hostname`` and the ``ssl_crlfile``/``ssl_ciphers``
options), so a file that cannot be read, a wrong key password or an expired certificate is one
clear line before anything connects, and the probe (:mod:`kstore.kafka.probe`) checks the brokers
with the very same context. kafka-python is given the context; librdkafka the files, once the
context has loaded them.
"""

from __future__ import annotations

import importlib
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kstore.errors import ConfigurationError
from kstore.settings import Settings


class TokenProvider(Protocol):
    """What kstore asks of a token provider: the current token (kafka-python's
    ``AbstractTokenProvider`` is one)."""

    def token(self) -> str: ...


#: Options kstore folds into the SSL context it builds (kafka-python ignores them once given a context).
SSL_CONTEXT_OPTIONS = ("ssl_crlfile", "ssl_ciphers")


def ssl_context(settings: Settings, options: Mapping[str, Any]) -> ssl.SSLContext | None:
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


class _CallableTokenProvider:
    """Wraps a plain function returning a token string, called at each authentication."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self._fn = fn

    def token(self) -> str:
        return self._fn()


def load_token_provider(spec: str) -> TokenProvider:
    """``MODULE:CALLABLE``: a class with a ``token()`` method (instantiated without arguments, such as a
    kafka-python ``AbstractTokenProvider`` subclass), an instance of one, or a function returning the
    current token string."""
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
    if isinstance(target, type) and callable(getattr(target, "token", None)):
        provider: TokenProvider = target()
        return provider
    if not isinstance(target, type) and callable(getattr(target, "token", None)):
        return target  # type: ignore[no-any-return]
    if callable(target):
        return _CallableTokenProvider(target)
    raise ConfigurationError(f"sasl_oauth_token_provider {spec!r} is neither a function nor a token provider")


def probe_config(settings: Settings) -> dict[str, Any]:
    """What the probe (:mod:`kstore.kafka.probe`) needs besides the settings, made without a client
    library: the TLS context, and the token provider (loading each names a mistake at once)."""
    options = settings.kafka_options if settings.kafka_client == "kafka-python" else {}
    config: dict[str, Any] = {}
    context = ssl_context(settings, options)
    if context is not None:
        config["ssl_context"] = context
    if settings.sasl_mechanism and settings.sasl_oauth_token_provider:
        config["sasl_oauth_token_provider"] = load_token_provider(settings.sasl_oauth_token_provider)
    return config
