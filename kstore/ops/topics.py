"""``kstore topics``: the topics a processor consumes (``topics``) and produces to (``produces``), as
the cluster has them, and creating the missing ones (kstore never creates a topic by itself: a worker
refuses to start without them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kstore.errors import ConfigurationError
from kstore.kafka.clients import admin_reader
from kstore.processor import Processor
from kstore.running.hooks import dead_letter_topic, declared_topics
from kstore.settings import Settings


@dataclass(frozen=True)
class TopicState:
    """One of a processor's topics: ``input`` or ``output``, its partitions (0: it does not exist),
    and whether this command created it."""

    topic: str
    role: str
    partitions: int
    created: bool = False

    @property
    def exists(self) -> bool:
        return self.partitions > 0


def _roles(settings: Settings, processor: Processor) -> dict[str, str]:
    inputs = list(settings.topics or processor.topics)
    outputs = sorted(declared_topics(processor) or ())
    roles = {t: "input" for t in inputs}
    for topic in outputs:
        roles[topic] = "input, output" if topic in roles else "output"
    letters_topic = dead_letter_topic(processor, settings)
    if letters_topic is not None:
        roles[letters_topic] = "dead letters"
    if not roles:
        raise ConfigurationError(f"{type(processor).__name__} declares no topics (topics = [...], produces = [...])")
    return roles


def list_topics(settings: Settings, processor: Processor) -> list[TopicState]:
    """The processor's input and declared output topics, with their partitions at the brokers (0: missing)."""
    roles = _roles(settings, processor)
    reader = admin_reader(settings)
    try:
        counts = reader.partition_counts(list(roles))
    finally:
        reader.close()
    return [TopicState(t, role, counts[t]) for t, role in roles.items()]


def create_topics(settings: Settings, processor: Processor, partitions: int | None = None,
                  replication_factor: int | None = None) -> list[TopicState]:
    """Create the processor's input and declared output topics the cluster does not have, with
    ``partitions`` and ``replication_factor`` (None: the brokers' defaults); those there are left as they are."""
    for name, value in (("partitions", partitions), ("replication_factor", replication_factor)):
        if value is not None and value < 1:
            raise ConfigurationError(f"{name} must be at least 1, got {value}")
    roles = _roles(settings, processor)
    reader = admin_reader(settings)
    try:
        created, counts = reader.create_missing(list(roles), partitions, replication_factor)
    finally:
        reader.close()
    return [TopicState(t, role, counts[t], t in created) for t, role in roles.items()]
