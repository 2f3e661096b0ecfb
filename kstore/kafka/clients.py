"""The Kafka client the settings choose, imported only then: confluent-kafka (librdkafka) or
kafka-python, each a peer implementation of :mod:`kstore.kafka.seam`'s protocols.

A client that is not installed is one line naming its extra.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kstore.errors import ConfigurationError
from kstore.settings import Settings

from .seam import ConsumerSource

#: What makes the worker's consumer: ``(settings, group, topics, worker id)``.
SourceFactory = Callable[[Settings, str, Sequence[str], str], ConsumerSource]


def source_class(settings: Settings) -> SourceFactory:
    """The worker's consumer on ``settings.kafka_client``."""
    if settings.kafka_client != "confluent":
        from .kafkapython.consumer import KafkaPythonSource
        return KafkaPythonSource
    try:
        from .confluent.consumer import ConfluentSource
    except ImportError as exc:
        raise ConfigurationError(f"kafka_client confluent needs confluent-kafka ({exc}): "
                                 "pip install 'kstore[confluent]'") from None
    return ConfluentSource
