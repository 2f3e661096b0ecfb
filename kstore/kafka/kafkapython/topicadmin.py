"""A pipeline's topics at the brokers, for ``kstore topics``: how many partitions each has (0: none
such), and creating the missing ones. kstore never creates a topic by itself; an operator does, here.

Any kafka-python error comes out as :class:`~kstore.errors.BrokerError`, one line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kafka.errors import KafkaError, TopicAlreadyExistsError, UnknownTopicOrPartitionError

from kstore.errors import BrokerError
from kstore.settings import Settings

from .connect import open_admin

#: How long to wait for a created topic to have a leader for every partition.
CREATED_WAIT_MS = 30_000


@contextmanager
def _admin(settings: Settings) -> Iterator[Any]:
    admin = open_admin(settings)
    try:
        yield admin
    except KafkaError as exc:
        text = str(exc).strip()
        raise BrokerError(f"Kafka at {settings.bootstrap_servers}: "
                          f"{text.splitlines()[0] if text else type(exc).__name__}") from None
    finally:
        admin.close()


def partition_counts(settings: Settings, topics: Sequence[str]) -> dict[str, int]:
    """Each topic's partitions, 0 for a topic the cluster does not have (never created by asking)."""
    with _admin(settings) as admin:
        return _counts(admin, topics)


def _counts(admin: Any, topics: Sequence[str]) -> dict[str, int]:
    described = {d.get("name"): d for d in admin.describe_topics(list(topics))} if topics else {}
    counts = {}
    for topic in topics:
        entry = described.get(topic)
        if entry is None or entry.get("error_code") == UnknownTopicOrPartitionError.errno:
            counts[topic] = 0
        elif entry.get("error_code"):
            raise BrokerError(f"Kafka could not describe topic {topic!r}: error {entry['error_code']}")
        else:
            counts[topic] = len(entry.get("partitions") or ())
    return counts


def create_missing(settings: Settings, topics: Sequence[str], partitions: int | None,
                   replication_factor: int | None) -> tuple[list[str], dict[str, int]]:
    """Create those of ``topics`` the cluster does not have (None: the broker's default partitions or
    replication factor) and wait until each has its leaders. Returns the topics created and every
    topic's partitions afterwards. A topic made meanwhile by someone else counts as there."""
    with _admin(settings) as admin:
        missing = [t for t, n in _counts(admin, topics).items() if n == 0]
        if missing:
            spec = {t: {"num_partitions": partitions or -1, "replication_factor": replication_factor or -1}
                    for t in missing}
            answer = admin.create_topics(spec, raise_errors=False)
            refused = [(t["name"], t.get("error_message") or t["error_code"]) for t in answer.get("topics", [])
                       if t.get("error_code") not in (0, TopicAlreadyExistsError.errno)]
            if refused:
                raise BrokerError(f"Kafka at {settings.bootstrap_servers} refused to create "
                                  + "; ".join(f"{name!r}: {why}" for name, why in refused))
            admin.wait_for_topics(missing, timeout_ms=CREATED_WAIT_MS)
        return missing, _counts(admin, topics)
