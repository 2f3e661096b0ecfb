"""The schema registry as kstore asks it: a Confluent-API client built from the settings, and its
failures sorted into what they are.

- **An outage** (:class:`~kstore.RegistryUnavailableError`): no answer, a timeout, a server error,
  a refusal of kstore's credentials. Never the message's fault: the batch waits and is retried.
- **A message's fault** (:class:`UnknownSchemaError`): the schema id a record carries is not in
  the registry. The record is dead-lettered (or stops the worker), by policy; unless the registry
  knows nothing of the record's topic, which makes it an outage instead (:mod:`kstore.schemas.unknown`).

The client is confluent-kafka's ``SchemaRegistryClient`` (it caches schemas by id and ids by
schema, so a steady stream asks nothing per message). Its own retries are turned off: kstore's
backoff spaces the attempts, and a batch must not sit in a client's sleep while the worker is asked
to stop.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kstore.errors import ConfigurationError, RegistryUnavailableError
from kstore.settings import Settings

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The HTTP statuses of a registry that is there but cannot answer now (or will not answer kstore).
OUTAGE_STATUSES = frozenset({401, 403, 408, 429, 500, 502, 503, 504})
#: The registry's error code for a schema id it does not have.
SCHEMA_NOT_FOUND = 40403


class UnknownSchemaError(LookupError):
    """A record names a schema id the registry does not have: the record's fault, unless the registry
    turns out not to know the record's topic at all (see :mod:`kstore.schemas.unknown`)."""

    def __init__(self, message: str, *, schema_id: int | None = None, registry: Registry | None = None) -> None:
        super().__init__(message)
        #: The id the record names, and the registry that does not have it (None when not known): what the
        #: engine asks before blaming the record.
        self.schema_id = schema_id
        self.registry = registry


class SchemaRegistryMissingError(ConfigurationError):
    """A processor asked for a registry format, and no ``schema_registry_url`` is set."""


def needs_extras() -> ConfigurationError:
    return ConfigurationError(
        "the formats avro, protobuf and json-schema need the schema registry's libraries: "
        "pip install 'kstore[schemas]'")


@functools.lru_cache(maxsize=1)
def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's 'no answer' errors: confluent-kafka uses httpx2 where it is installed, else httpx."""
    found: list[type[BaseException]] = []
    for name in ("httpx2", "httpx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        found.append(module.TransportError)
    return tuple(found)


def outage_of(exc: BaseException, url: str) -> RegistryUnavailableError | None:
    """The outage ``exc`` is, or None if it is not one (a registry's answer about the request)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    if isinstance(exc, _transport_errors()):
        return RegistryUnavailableError(f"the schema registry at {url} does not answer ({type(exc).__name__})")
    if isinstance(exc, SchemaRegistryError) and (exc.http_status_code in OUTAGE_STATUSES or exc.http_status_code < 0):
        what = ("refused kstore's credentials" if exc.http_status_code in (401, 403)
                else "cannot answer")
        return RegistryUnavailableError(
            f"the schema registry at {url} {what} (HTTP {exc.http_status_code}: {exc.error_message})")
    return None


class Registry:
    """One registry client, its failures sorted (see the module's docstring)."""

    def __init__(self, client: SchemaRegistryClient, url: str) -> None:
        self.client = client
        #: For messages: the URL without credentials.
        self.url = url

    @classmethod
    def of(cls, settings: Settings) -> Registry:
        """The registry of ``settings.schema_registry_url`` (:class:`SchemaRegistryMissingError` if none)."""
        if not settings.schema_registry_url:
            raise SchemaRegistryMissingError(
                "the formats avro, protobuf and json-schema read their schemas from a schema registry: "
                "set schema_registry_url (--schema-registry-url, KSTORE_SCHEMA_REGISTRY_URL)")
        try:
            from confluent_kafka.schema_registry import SchemaRegistryClient
        except ImportError:
            raise needs_extras() from None
        conf: dict[str, Any] = {
            "url": settings.schema_registry_url,
            "timeout": settings.schema_registry_timeout_s,
            "max.retries": 0,
        }
        if settings.schema_registry_username is not None:
            password = settings.schema_registry_password or ""
            conf["basic.auth.user.info"] = f"{settings.schema_registry_username}:{password}"
        for name, key in (("schema_registry_cafile", "ssl.ca.location"),
                          ("schema_registry_certfile", "ssl.certificate.location"),
                          ("schema_registry_keyfile", "ssl.key.location")):
            if getattr(settings, name):
                conf[key] = getattr(settings, name)
        try:
            client = SchemaRegistryClient(conf)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"schema_registry_url: {exc}") from None
        return cls(client, _without_credentials(settings.schema_registry_url))

    @classmethod
    def in_memory(cls) -> Registry:
        """A registry in memory (confluent-kafka's own in-memory client: real ids, subjects and wire format),
        for :class:`kstore.testing.InMemoryRegistry`."""
        try:
            # Not in the package's public names, but its tested in-memory client (pinned to confluent-kafka 2).
            from confluent_kafka.schema_registry._sync.mock_schema_registry_client import MockSchemaRegistryClient
        except ImportError:
            raise needs_extras() from None
        return cls(MockSchemaRegistryClient({"url": "mock://kstore.testing"}), "memory")

    def ask(self, what: Callable[[], _T]) -> _T:
        """``what()``, with an outage raised as :class:`~kstore.RegistryUnavailableError`."""
        try:
            return what()
        except Exception as exc:
            outage = outage_of(exc, self.url)
            if outage is not None:
                raise outage from exc
            raise

    def schema(self, schema_id: int) -> Schema:
        """The schema of ``schema_id`` (cached by the client): :class:`UnknownSchemaError` if the registry
        has none, :class:`~kstore.RegistryUnavailableError` if it does not answer."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            return self.ask(lambda: self.client.get_schema(schema_id))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise UnknownSchemaError(f"schema id {schema_id} is not in the schema registry",
                                         schema_id=schema_id, registry=self) from None
            raise

    def subjects(self) -> list[str]:
        """Every subject the registry has, asked anew each time (the caller bounds how often): an answer
        that is not a list of subjects (an address that is not the registry's API) is an outage too,
        since the schema ids it does not find are then not the records' fault."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            return list(self.ask(self.client.get_subjects))
        except SchemaRegistryError as exc:
            raise RegistryUnavailableError(
                f"the schema registry at {self.url} does not list its subjects (HTTP {exc.http_status_code}: "
                f"{exc.error_message}): is schema_registry_url the registry's API?") from None

    def check(self) -> None:
        """Ask the registry something cheap (its subjects): at a worker's start, a registry that does
        not answer, or an address that is not a registry's API, is one clear line, not a wait."""
        self.subjects()


def _without_credentials(url: str) -> str:
    """``url`` (a comma-separated list) with any ``user:password@`` left out."""
    from urllib.parse import urlsplit, urlunsplit

    shown = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        shown.append(urlunsplit((parts.scheme, host, parts.path, "", "")))
    return ",".join(shown)
