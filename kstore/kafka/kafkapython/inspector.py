"""Questions to the brokers for the operator's tools (``kstore offsets``, ``kstore top``): a topic's
partitions, log bounds, offsets by time, and the live members of a group; and the one write,
:meth:`KafkaInspector.mirror_move`: an operator's move of a group whose offsets are mirrored to
Kafka (``mirror_offsets``), copied to its committed offsets there while no member is live.

Brokers answer "not now" for a moment after they start, or while leadership moves: the
group coordinator is not available yet or still loading, a partition's leader is elsewhere.
kafka-python raises those as retriable errors; :meth:`KafkaInspector._ask` asks again (a debug
log line each time) for up to ``connect_timeout_s``, and then (or at once, for an error that is not
transient) raises :class:`~kstore.errors.BrokerError`: one line for the command.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar

from kafka import OffsetAndMetadata, TopicPartition
from kafka.errors import BrokerResponseError, KafkaError, NoError, NotCoordinatorError

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.seam import MIRROR_METADATA, committed_metadata
from kstore.records import TopicPartition as TP
from kstore.settings import Settings

from .connect import open_admin, open_consumer
from .consumer import log_bounds, offsets_for_times
from .members import group_error, view_of

log = logging.getLogger(__name__)

#: First and longest wait before asking again after a transient answer (doubling in between).
RETRY_DELAY_S = 0.2
RETRY_MAX_DELAY_S = 2.0

_T = TypeVar("_T")

#: What :meth:`KafkaInspector.mirror_move` did: the group does not mirror (nothing to do), its
#: committed offsets in Kafka moved, or they are left to its live members (which mirror them).
MirrorMove = Literal["not mirrored", "moved", "left to live workers"]


class KafkaInspector:
    """Read-only questions to the brokers for ``kstore offsets``: partitions, log bounds, group members."""

    def __init__(self, settings: Settings, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._sleep, self._clock = sleep, clock
        self.consumer = open_consumer(settings, group_id=None, enable_auto_commit=False,
                                      allow_auto_create_topics=False)
        try:
            self.admin = open_admin(settings)
        except BaseException:
            self.consumer.close(autocommit=False)
            raise

    def partitions(self, topic: str) -> list[int]:
        found = self._ask(f"list the partitions of {topic!r}", lambda: self.consumer.partitions_for_topic(topic))
        if not found:
            raise ConfigurationError(f"unknown topic {topic!r} at {self.settings.bootstrap_servers}")
        return sorted(found)

    def log_bounds(self, tps: Sequence[TP]) -> dict[TP, tuple[int, int]]:
        return self._ask(f"read the log bounds of {len(tps)} partition(s)", lambda: log_bounds(self.consumer, tps))

    def offsets_for_times(self, targets: dict[TP, datetime]) -> dict[TP, int | None]:
        return self._ask("look up offsets by time", lambda: offsets_for_times(self.consumer, targets))

    def live_owners(self, group: str, registered: Collection[str] | None = None) -> dict[TP, str]:
        """Which live member of the Kafka group is assigned each partition, by its client id (a kstore
        worker's name, as in its logs and the database, unless ``client_id`` is set); with
        ``registered`` (the names and Kafka member ids of the workers a database's registry holds
        for the group), only the members it names: those that write to that database."""
        described = self._ask(f"describe group {group!r}", lambda: self._describe(group))
        owners: dict[TP, str] = {}
        for member in described.get("members", []):
            who = str(member.get("client_id") or member.get("member_id"))
            if registered is not None and who not in registered and member.get("member_id") not in registered:
                continue
            assignment = member.get("member_assignment") or {}
            for entry in assignment.get("assigned_partitions", []) if isinstance(assignment, dict) else []:
                for partition in entry.get("partitions", []):
                    owners[(entry["topic"], partition)] = who
        return owners

    def mirror_move(self, group: str, offsets: Mapping[TP, int], *, mirrors: bool = False) -> MirrorMove:
        """After an operator's move of ``group`` in the database: where the group mirrors its offsets
        to Kafka (``mirrors``, or the metadata of its committed offsets there says so), write the
        new ones there too, unless a live member owns a partition of the group: its worker mirrors
        them itself once it has followed the move (and Kafka takes no offsets but its members'
        then). kstore never reads these offsets: they only keep Kafka's lag tools right.
        Raises :class:`BrokerError` if the brokers refuse.
        """
        committed = self._ask(f"read the committed offsets of group {group!r}",
                              lambda: self.admin.list_group_offsets({group: None}).get(group, {}))
        if not mirrors and not any(committed_metadata(o) == MIRROR_METADATA for o in committed.values()):
            return "not mirrored"
        if self.live_owners(group):
            return "left to live workers"
        new = {TopicPartition(*tp): OffsetAndMetadata(offset, MIRROR_METADATA, -1) for tp, offset in offsets.items()}
        answers = self._ask(f"commit the offsets of group {group!r}",
                            lambda: self.admin.alter_group_offsets(group, new))
        refused = sorted({_reason(error()) for error in answers.values() if error is not NoError})
        if refused:
            # A member that joined since the look above (Kafka refuses offsets from outside a live
            # group): it mirrors them itself.
            raise BrokerError(f"Kafka at {self.settings.bootstrap_servers} refused the offsets of group "
                              f"{group!r}: {', '.join(refused)}")
        return "moved"

    def _describe(self, group: str) -> dict[str, Any]:
        described: dict[str, Any] = self.admin.describe_groups([group]).get(group, {})
        # kafka-python gives a group's own error (its coordinator still loading, say) as text in
        # the answer, not raised: a transient one is raised here, to be asked again.
        error = group_error(described.get("error"))
        if error is not None and error.retriable:
            raise error(described["error"])
        return described

    def _ask(self, what: str, question: Callable[[], _T]) -> _T:
        """``question()``, asked again after a transient answer until ``connect_timeout_s`` has passed."""
        where, patience = self.settings.bootstrap_servers, self.settings.connect_timeout_s
        deadline = self._clock() + patience
        delay = RETRY_DELAY_S
        while True:
            try:
                return question()
            except KafkaError as exc:
                if not exc.retriable:
                    raise BrokerError(f"Kafka at {where} could not {what}: {_reason(exc)}") from None
                if self._clock() + delay > deadline:
                    raise BrokerError(f"Kafka at {where} could not {what} within {patience:g}s "
                                      f"(connect_timeout_s): still {_reason(exc)}") from None
                # Debug: a command that succeeds in the end prints nothing on stderr; one that does not,
                # its one line (--log-level DEBUG shows each try).
                log.debug("Kafka at %s cannot %s yet (%s): asking again in %.1fs", where, what, _reason(exc), delay)
                self._sleep(delay)
                delay = min(delay * 2, RETRY_MAX_DELAY_S)
                if isinstance(exc, NotCoordinatorError):
                    # kafka-python keeps the coordinator it found and has no way to forget it: a
                    # new admin client looks it up again.
                    self.admin.close()
                    self.admin = open_admin(self.settings)

    def close(self) -> None:
        self.consumer.close(autocommit=False)
        self.admin.close()


def settled_members(admin: Any, group: str) -> set[str] | None:
    """The client ids of a classic consumer group's members once it is settled (``Stable``), or
    None while it rebalances or if the brokers cannot say (a ``consumer``-protocol group is not
    described here). One request to the group's coordinator; a KafkaError is the caller's."""
    described: dict[str, Any] = admin.describe_groups([group]).get(group, {})
    if described.get("error") is not None:
        return None
    view = view_of(described)
    return {m.client_id for m in view.members} if view.settled else None


def _reason(exc: KafkaError) -> str:
    """The broker's name for an error (``COORDINATOR_NOT_AVAILABLE``), or the client's first line."""
    if isinstance(exc, BrokerResponseError) and exc.message:
        return str(exc.message)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
