"""Which Kafka client kstore uses, from the settings: the worker's consumer (``kafka_client``), the
relay's publisher (``relay_client``), and the operator's tools (``kafka_client`` when installed,
else the other installed client).

The client libraries are extras (``pip install 'kstore[confluent]'``, ``'kstore[kafka-python]'``):
each is imported here only when chosen, so importing kstore imports neither, and a client that is
not installed is one line naming its extra (:class:`~kstore.errors.ConfigurationError`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kstore.errors import ConfigurationError
from kstore.settings import Settings

from .seam import AdminReader, ConsumerSource, PartitionCounts

if TYPE_CHECKING:
    from .confluent.producer import ConfluentShardPublisher
    from .kafkapython.producer import KafkaPythonShardPublisher

#: What makes the worker's consumer: ``(settings, group, topics, worker id)``.
SourceFactory = Callable[[Settings, str, Sequence[str], str], ConsumerSource]

log = logging.getLogger(__name__)

#: Each client kstore runs on (its name in the settings, and the extra that installs it): the module it
#: imports, and the distribution that module comes in.
CLIENTS = {"confluent": ("confluent_kafka", "confluent-kafka"), "kafka-python": ("kafka", "kafka-python")}


def installed(client: str) -> bool:
    """Whether ``client``'s library can be imported here."""
    try:
        return importlib.util.find_spec(CLIENTS[client][0]) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules (made unimportable)
        return False


def require(client: str, setting: str = "kafka_client") -> None:
    """Raise the one-line ConfigurationError naming the extra if ``client``'s library is not installed."""
    if not installed(client):
        raise ConfigurationError(f"{setting} {client} needs {CLIENTS[client][1]}: pip install 'kstore[{client}]'")


def tools_client(settings: Settings) -> str:
    """The client the operator's tools use: ``kafka_client`` if installed, else the other installed one."""
    if installed(settings.kafka_client):
        return settings.kafka_client
    other = next((c for c in CLIENTS if c != settings.kafka_client and installed(c)), None)
    if other is None:
        require(settings.kafka_client)
    log.debug("kafka_client %s is not installed: the operator's tools use %s", settings.kafka_client, other)
    return str(other)


def source_class(settings: Settings) -> SourceFactory:
    """The worker's consumer for ``settings.kafka_client``: kafka-python's, or confluent-kafka's."""
    require(settings.kafka_client)
    if settings.kafka_client == "confluent":
        from .confluent.consumer import ConfluentSource

        return ConfluentSource
    from .kafkapython.consumer import KafkaPythonSource

    return KafkaPythonSource


def publisher_class(client: str) -> type[ConfluentShardPublisher] | type[KafkaPythonShardPublisher]:
    """The outbox relay's shard publisher for setting ``relay_client``: a transport, made with
    ``(settings, transactional_id, max_record_bytes)``, that satisfies the relay's protocol
    (:class:`kstore.relay.publisher.PublisherFactory`) by its shape."""
    require(client, "relay_client")
    if client == "confluent":
        from .confluent.producer import ConfluentShardPublisher

        return ConfluentShardPublisher
    from .kafkapython.producer import KafkaPythonShardPublisher

    return KafkaPythonShardPublisher


def admin_reader(settings: Settings, *, relay: bool = False, request_timeout_s: float | None = None,
                 patience_s: float | None = None) -> AdminReader:
    """The brokers' answers for the operator's tools, on :func:`tools_client`'s client; with ``relay``,
    for the relay (its shards' progress, its group's members), on ``relay_client``. Opens no connection yet."""
    if relay:
        client = settings.relay_client
        require(client, "relay_client")
    else:
        client = tools_client(settings)
    options: dict[str, Any] = {"request_timeout_s": request_timeout_s, "patience_s": patience_s}
    if client == "confluent":
        from .confluent.admin import ConfluentAdmin

        return ConfluentAdmin(settings, **options)
    from .kafkapython.admin import KafkaPythonAdmin

    return KafkaPythonAdmin(settings, **options)


def partition_counts(settings: Settings) -> PartitionCounts:
    """Topics' partition counts for checking what a processor produces, on the operator's tools' client:
    a question the brokers do not answer is not asked again (the record goes on; see :class:`PartitionCounts`)."""
    return PartitionCounts(settings, lambda: admin_reader(settings, patience_s=0))
