"""Before a record is blamed for a schema id the registry does not have: is it the record, or the
registry? :class:`UnknownIds`.

A record that names an unknown schema id is the record's fault (dead-lettered, or it stops the
worker, by policy). But a worker pointed at the wrong registry (a staging URL), or at one that lost
its schemas (a development registry restarted without its storage), meets an unknown id in every
record and would dead-letter them all. So an unknown id is first weighed against what the registry
knows, and is taken as an outage (:class:`~kstore.RegistryUnavailableError`: the batch waits and is
retried with backoff, nothing is dead-lettered, ``/readyz`` says why) when:

- the registry has no subject at all (new, or emptied);
- its subjects are named after topics (``<topic>-value``, ``<topic>-key``), none after this record's
  topic (nor ``<topic>-<record name>``), and no record of the topic has decoded in this process: it is
  not this topic's registry. (A registry whose subjects are all record names cannot say this.)
- :data:`DISTINCT_IDS_IN_A_ROW` different unknown ids came in a row on the topic, none of its records
  decoding in between: the records carry another registry's ids.

Otherwise (the registry knows the topic and its other records decode) the record is at fault. The
subjects are asked at most every :data:`SUBJECTS_TTL_S` per registry, so neither a run of bad records
nor a batch waiting through such an outage hammers the registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from kstore.errors import RegistryUnavailableError

from .registry import UnknownSchemaError

#: Different unknown ids in a row on one topic (none of its records decoding in between) that are taken
#: as the registry's fault: one bad id is a producer's bug, but several, with nothing known in between,
#: are another registry's. Three tells it from a bad record or two among good ones; the records of the
#: first two ids may be dead-lettered before the worker starts waiting.
DISTINCT_IDS_IN_A_ROW = 3
#: How long a registry's list of subjects is trusted before it is asked again.
SUBJECTS_TTL_S = 5.0
#: The subjects TopicNameStrategy names after a topic: ``<topic>-key``, ``<topic>-value``.
_TOPIC_SUFFIXES = ("-key", "-value")


class KnowsSubjects(Protocol):
    """What is asked of a registry here (:class:`~kstore.schemas.Registry` is one)."""

    #: For messages: the registry's URL without credentials.
    url: str

    def subjects(self) -> list[str]:
        """Every subject it has; :class:`~kstore.RegistryUnavailableError` if it does not answer."""
        ...


class _Subjects(NamedTuple):
    """A registry's subjects as last asked."""

    asked_at: float
    #: No subject at all.
    empty: bool
    #: Some subjects are named after topics (``<topic>-value``), so a topic without one is not its.
    topic_named: bool
    #: The topics subjects are named after (the name before a subject's last ``-``).
    topics: frozenset[str]

    @classmethod
    def of(cls, subjects: list[str], asked_at: float) -> _Subjects:
        return cls(asked_at, not subjects, any(s.endswith(_TOPIC_SUFFIXES) for s in subjects),
                   frozenset(s.rpartition("-")[0] for s in subjects if "-" in s))


class UnknownIds:
    """Weighs the unknown schema ids a worker's records name (see the module's docstring). Not
    thread-safe: the batch loop alone calls it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl: float = SUBJECTS_TTL_S) -> None:
        self._clock = clock
        self._ttl = ttl
        #: Per registry URL: its subjects as last asked.
        self._subjects: dict[str, _Subjects] = {}
        #: Topics of which a record has decoded in this process: their registry is evidently theirs.
        self._decoded: set[str] = set()
        #: Per topic: the different unknown ids met since its last record that decoded (at most the threshold).
        self._rows: dict[str, list[int]] = {}

    def decoded(self, topics: Iterable[str]) -> None:
        """Records of ``topics`` decoded: their rows of unknown ids end."""
        for topic in topics:
            self._decoded.add(topic)
            self._rows.pop(topic, None)

    def blame(self, topic: str, error: UnknownSchemaError) -> RegistryUnavailableError | None:
        """The outage a record of ``topic`` that raised ``error`` is a sign of, or None: the record is
        at fault. One whose error does not say its id and registry (a custom ``deserialize`` raised it)
        is at fault as before."""
        if error.schema_id is None or error.registry is None:
            return None
        return self.weigh(error.registry, topic, error.schema_id)

    def weigh(self, registry: KnowsSubjects, topic: str, schema_id: int) -> RegistryUnavailableError | None:
        """A record of ``topic`` names ``schema_id``, which ``registry`` does not have: the outage that
        is, or None (the record's fault). Raises :class:`~kstore.RegistryUnavailableError` if the
        registry does not answer when asked its subjects."""
        row = self._rows.setdefault(topic, [])
        if schema_id not in row and len(row) < DISTINCT_IDS_IN_A_ROW:
            row.append(schema_id)
        why = self._why(self._subjects_of(registry), topic, row)
        if why is None:
            return None
        return RegistryUnavailableError(f"the schema registry at {registry.url} {why}")

    def _why(self, subjects: _Subjects, topic: str, row: list[int]) -> str | None:
        """What is wrong with the registry, or None. The text names the row's first id, the same for
        every record while it lasts: the outage is logged once, and /readyz says one thing."""
        first = row[0]
        if subjects.empty:
            return (f"knows no schema at all (is it the right registry, or was it emptied?): the records of topic "
                    f"{topic} name schema id {first}")
        if subjects.topic_named and topic not in subjects.topics and topic not in self._decoded:
            return (f"knows no schema for topic {topic} (is it the right registry, or was it emptied?): its records "
                    f"name schema id {first}")
        if len(row) >= DISTINCT_IDS_IN_A_ROW:
            return (f"knows none of {len(row)} different schema ids the records of topic {topic} named in a row "
                    f"(is it the right registry, or did it lose schemas?): {', '.join(map(str, row))}")
        return None

    def _subjects_of(self, registry: KnowsSubjects) -> _Subjects:
        """``registry``'s subjects, asked again once they are ``ttl`` old."""
        now = self._clock()
        known = self._subjects.get(registry.url)
        if known is None or now - known.asked_at >= self._ttl:
            known = self._subjects[registry.url] = _Subjects.of(registry.subjects(), now)
        return known
