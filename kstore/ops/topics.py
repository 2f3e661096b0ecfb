"""``kstore topics``: the topics a processor consumes (``topics``) and produces to (``produces``), or
topics named one by one (an application outbox's, which no processor declares), as the cluster has
them, and creating the missing ones (kstore never creates a topic by itself: a worker refuses to
start without them).

A processor is named ``MODULE:CLASS`` (or ``path/to/file.py:CLASS``), a topic by its name, which
Kafka allows only letters, digits, ``.``, ``_`` and ``-`` in: a ``:`` tells the two apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kstore.errors import ConfigurationError
from kstore.kafka.clients import admin_reader
from kstore.processor import Processor
from kstore.running.hooks import dead_letter_topic, declared_topics
from kstore.settings import Settings

#: A topic name Kafka accepts (besides "." and ".."): these characters, at most 249 of them.
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


@dataclass(frozen=True)
class TopicState:
    """One of a processor's topics (``input``, ``output``, ``dead letters``) or a topic named by
    itself (role None), its partitions (0: it does not exist), and whether this command created it."""

    topic: str
    role: str | None
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


def _check_sizes(partitions: int | None, replication_factor: int | None) -> None:
    for name, value in (("partitions", partitions), ("replication_factor", replication_factor)):
        if value is not None and value < 1:
            raise ConfigurationError(f"{name} must be at least 1, got {value}")


def create_topics(settings: Settings, processor: Processor, partitions: int | None = None,
                  replication_factor: int | None = None) -> list[TopicState]:
    """Create the processor's input and declared output topics the cluster does not have, with
    ``partitions`` and ``replication_factor`` (None: the brokers' defaults); those there are left as they are."""
    _check_sizes(partitions, replication_factor)
    roles = _roles(settings, processor)
    reader = admin_reader(settings)
    try:
        created, counts = reader.create_missing(list(roles), partitions, replication_factor)
    finally:
        reader.close()
    return [TopicState(t, role, counts[t], t in created) for t, role in roles.items()]


def _topic_names(names: Sequence[str]) -> list[str]:
    for name in names:
        if not _TOPIC_NAME.fullmatch(name) or name in (".", ".."):
            raise ConfigurationError(f"{name!r} is neither a Kafka topic name (letters, digits, '.', '_' and '-', at "
                                     f"most 249) nor a processor (MODULE:CLASS or path/to/file.py:CLASS)")
    return list(dict.fromkeys(names))


def _check_partitions(counts: dict[str, int], partitions: int | None, bootstrap: str) -> None:
    """A topic there with other partitions than asked for is not the topic wanted: Kafka can add
    partitions but never take them away, and kstore changes no topic it did not create."""
    for topic, found in counts.items():
        if partitions is not None and found and found != partitions:
            raise ConfigurationError(f"topic {topic!r} exists at {bootstrap} with {found} partition(s), not "
                                     f"{partitions}: kstore leaves it as it is")


def list_named_topics(settings: Settings, names: Sequence[str]) -> list[TopicState]:
    """The topics ``names`` with their partitions at the brokers (0: missing)."""
    topics = _topic_names(names)
    reader = admin_reader(settings)
    try:
        counts = reader.partition_counts(topics)
    finally:
        reader.close()
    return [TopicState(t, None, counts[t]) for t in topics]


def create_named_topics(settings: Settings, names: Sequence[str], partitions: int | None = None,
                        replication_factor: int | None = None) -> list[TopicState]:
    """Create the topics ``names`` the cluster does not have (None: the brokers' defaults). One that is
    there already is fine with the partitions asked for (any, if none is asked for), and a
    ConfigurationError with others, raised before any topic is created."""
    _check_sizes(partitions, replication_factor)
    topics = _topic_names(names)
    reader = admin_reader(settings)
    try:
        _check_partitions(reader.partition_counts(topics), partitions, settings.bootstrap_servers)
        created, counts = reader.create_missing(topics, partitions, replication_factor)
    finally:
        reader.close()
    # One created meanwhile by someone else is checked as well.
    _check_partitions({t: n for t, n in counts.items() if t not in created}, partitions, settings.bootstrap_servers)
    return [TopicState(t, None, counts[t], t in created) for t in topics]


def list_or_create(settings: Settings, targets: Sequence[str], load: Callable[[str], Processor], *,
                   create: bool = False, partitions: int | None = None, replication_factor: int | None = None,
                   inputs_replaced: bool = False) -> list[TopicState]:
    """``kstore topics list|create TARGET...``: one processor (``MODULE:CLASS``, made by ``load``) or
    topic names. ``inputs_replaced``: the caller replaced a processor's input topics (``settings.topics``),
    which topics named by themselves have none of."""
    processors = [t for t in targets if ":" in t]
    if processors and (len(processors) > 1 or len(targets) > 1):
        raise ConfigurationError("give one processor (MODULE:CLASS) or topic names, not both nor several processors")
    if not targets:
        raise ConfigurationError("give a processor (MODULE:CLASS) or topic names")
    if not processors and inputs_replaced:
        raise ConfigurationError("--topic replaces a processor's input topics: name topics as arguments instead")
    if processors:
        processor = load(processors[0])
        if create:
            return create_topics(settings, processor, partitions, replication_factor)
        return list_topics(settings, processor)
    if create:
        return create_named_topics(settings, targets, partitions, replication_factor)
    return list_named_topics(settings, targets)
