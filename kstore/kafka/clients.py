"""Which Kafka client the worker consumes with: kafka-python's :class:`~kstore.kafka.kafkapython.consumer.KafkaSource`
(the default) or confluent-kafka's :class:`~kstore.kafka.confluent.ConfluentSource` (``kafka_client``).

confluent-kafka is an extra (``pip install 'kstore[confluent]'``): it is imported only when chosen.
"""

from __future__ import annotations

from kstore.errors import ConfigurationError
from kstore.settings import Settings

from .kafkapython.consumer import KafkaSource


def source_class(settings: Settings) -> type[KafkaSource]:
    """The :class:`KafkaSource` of ``settings.kafka_client``: kafka-python's, or confluent-kafka's."""
    if settings.kafka_client != "confluent":
        return KafkaSource
    try:
        from .confluent.consumer import ConfluentSource
    except ImportError as exc:
        raise ConfigurationError(f"kafka_client confluent needs confluent-kafka ({exc}): "
                                 "pip install 'kstore[confluent]'") from None
    return ConfluentSource
