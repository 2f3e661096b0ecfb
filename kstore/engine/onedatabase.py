"""One pipeline, one database: a worker refuses to process for a group whose other live members
write to another database (two databases would each hold part of the pipeline's effects and offsets).

Kafka does not know which database a member writes to; each database does know which of the
group's workers write to it: every worker keeps a row in its database's registry
(:mod:`kstore.db.members`) from before it joins the group until it stops. After each assignment,
and before it claims any partition of it, the worker describes the group (the admin API of the
client in use) and looks its live members up in its own database's registry: a member is known if
its client id is a registered worker's name, or its member id a registered member id. The same
holds on every Kafka client and every rebalance protocol; no assignor is involved.

Who gives way when each side sees the other as unknown (refusing on both sides would stop the
pipeline that runs):

- a worker that is **established** (it has claimed a partition of the group since it started), or
  beside another established worker of its database that is a member of the group now, goes on,
  and logs an error naming each unknown member once per rebalance;
- any other worker **refuses**: :class:`~kstore.errors.ConfigurationError` before it claimed or
  committed anything; it leaves the group, so the partitions go back to the established workers.

So a stray worker pointed at another database is refused within a rebalance, and the pipeline
that runs goes on. Two workers started together on two databases, neither established yet, both
refuse: a worker about to refuse judges a settled group (an unknown member seen while the group
rebalances may be on its way out), and stays in the group :data:`REFUSAL_LINGER_S` before it
leaves, so the other side, judging the same rebalance, sees it too. A member id is known only
after the join, so where ``client_id`` is set by the user (a client id then names no registry row)
an unknown member may be mid-registration: it is given :data:`REGISTRATION_GRACE_S` to appear.
These waits happen only when there is an unknown member, so a worker starting alone, or beside
workers of its own database, is not slowed.

Never two databases at once: a worker claims only after it judged a group in which every member
was known here (or when it, or another worker here, had already claimed); a worker that joins
later sees it, and refuses unless it was itself established. Safety never rests on timing: the
waits only decide who gives way.

Every registry write is a short transaction of its own, never inside a batch; the row is
refreshed every :data:`REFRESH_S` at most (not per batch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable

from sqlalchemy.exc import SQLAlchemyError

from kstore.db.members import GroupMembers, Registered, stale_after_s
from kstore.errors import BrokerError, ConfigurationError, KstoreError
from kstore.kafka.seam import ConsumerSource, GroupMember
from kstore.settings import Settings

log = logging.getLogger("kstore.engine.worker")

#: How often a worker refreshes its registry row (and looks again at members still unknown).
REFRESH_S = 5.0
#: How long a member may stay unknown while it may still be registering (``client_id`` set).
REGISTRATION_GRACE_S = 10.0
#: While waiting for such a member, or for the group to settle: how often the registry and the group are read again.
GRACE_RECHECK_S = 0.5
#: How often a worker given nothing yet judges its group all the same.
UNASSIGNED_LOOK_S = 1.0
#: How long a refused worker stays in the group before it leaves (see OneDatabase._judge).
REFUSAL_LINGER_S = 2.0


def unknown_members(members: Iterable[GroupMember], registered: Collection[Registered], database_id: str,
                    me: str | None) -> list[GroupMember]:
    """The members no registry row names (nor, for a worker of an older release, its own word about
    its database), leaving out this worker itself (member id ``me``)."""
    names = {r.member for r in registered}
    ids = {r.kafka_member_id for r in registered if r.kafka_member_id}
    return [m for m in members if m.member_id != me and m.client_id not in names and m.member_id not in ids
            and m.told_database != database_id]


def established_in_group(registered: Collection[Registered], members: Iterable[GroupMember], me: str) -> bool:
    """Whether another worker of this database that has claimed is a member of the group now. A row
    alone is not enough: a worker that crashed keeps its row until it goes stale, and a stray that
    joined in the meantime must not be outvoted by it."""
    members = list(members)
    names = {m.client_id for m in members}
    ids = {m.member_id for m in members}
    return any(r.claimed and r.member != me and (r.member in names or (r.kafka_member_id or "") in ids)
               for r in registered)


def describe(members: Iterable[GroupMember]) -> str:
    return ", ".join(f"member {m.member_id} (client id {m.client_id})" for m in members)


class OneDatabase:
    """A worker's guard: its registry row, and the judgement of its group's members after each join.

    Used on the worker's main thread only. Database and broker errors of :meth:`check` are the
    caller's to retry (the partitions stay unclaimed meanwhile); those of the row's refresh only wait
    for the next one.
    """

    def __init__(self, settings: Settings, group: str, member: str, registry: GroupMembers, source: ConsumerSource,
                 database_id: str, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings, self.group, self.member = settings, group, member
        self.registry, self.source, self.database_id = registry, source, database_id
        self._clock, self._sleep = clock, sleep
        self._stale_after = stale_after_s(settings.session_timeout_ms)
        #: This worker has claimed a partition of the group since it started.
        self.established = False
        self._judged = 0  # the source's join count last judged
        self._next_refresh = 0.0
        self._next_unassigned_look = 0.0
        #: Unknown members an established worker still looks at (``client_id`` set): since when.
        self._suspects: dict[str, float] = {}
        self._reported: set[str] = set()
        #: The registry's live rows and the group's members, as the last look found them.
        self._registered: list[Registered] = []
        self._members: list[GroupMember] = []

    def register(self) -> None:
        """Before the worker joins the group: its row, so that workers of this database starting
        at the same time know it. A SQLAlchemyError is the caller's."""
        self.registry.register(self.member)
        self._next_refresh = self._clock() + REFRESH_S

    @property
    def judged(self) -> bool:
        """Whether the last assignment has been judged (only then may its partitions be claimed)."""
        return self._judged == self.source.joins

    def claimed(self) -> None:
        """This worker claimed partitions of the group: established from now on, and its row says so
        at once (a worker of this database that joins meanwhile goes on beside it)."""
        if not self.established:
            self.established = True
            self._next_refresh = 0.0
            self._refresh()

    def check(self) -> None:
        """Judge the group after a new assignment, and look again at members still suspected; refresh
        the registry row when due. Raises :class:`ConfigurationError` to refuse."""
        joins = self.source.joins
        if joins != self._judged:
            self._judge()
            self._judged = joins
        elif joins == 0 and self._clock() >= self._next_unassigned_look:
            # Nothing assigned yet: with `consumer` (KIP-848) a member given no partition is never
            # called back, so a stray among enough workers would never be judged. Looked at now and then.
            self._next_unassigned_look = self._clock() + UNASSIGNED_LOOK_S
            try:
                self._judge()
            except (SQLAlchemyError, BrokerError) as exc:  # not joined yet, say: the next look, or the assignment
                log.debug("could not look at group %r yet: %s", self.group, exc)
        elif self._clock() >= self._next_refresh:
            self._refresh()

    def forget(self) -> None:
        """A clean stop: the row goes (errors only logged; a row left behind goes stale)."""
        try:
            self.registry.forget(self.member)
        except SQLAlchemyError as exc:  # the database is away: the row goes stale by itself
            log.debug("could not remove worker %s from the registry of group %r: %s", self.member, self.group, exc)

    # -- the judgement ------------------------------------------------------------------------

    def _judge(self) -> None:
        joins = self.source.joins
        self._reported.clear()
        self._suspects.clear()
        unknown, settled = self._look()
        if unknown and not self._goes_on():
            unknown = self._wait(unknown, settled, joins)
            if self.source.joins != joins:
                return  # a newer assignment came meanwhile: that one is judged next
        if not unknown:
            return
        if not self._goes_on():
            # Stay in the group a moment before leaving: a worker on the other side judging the
            # same rebalance sees this one too, and refuses as well (neither goes on).
            self._sleep(REFUSAL_LINGER_S)
            raise ConfigurationError(
                f"group {self.group!r} is already consumed by workers writing to another database "
                f"({describe(unknown)}, not a worker of {self.settings.safe_dsn}): one pipeline, one database; "
                "give this worker the group's database, or another group")
        self._suspect(unknown)

    def _look(self) -> tuple[list[GroupMember], bool]:
        """Refresh this worker's row (with its member id), then compare the group with the registry:
        the members unknown here, and whether the group was settled."""
        self.registry.seen(self.member, kafka_member_id=self.source.member_id, claimed=self.established)
        self._next_refresh = self._clock() + REFRESH_S
        view = self.source.group_members()
        self._registered = self.registry.live(self._stale_after)
        self._members = list(view.members)
        unknown = unknown_members(self._members, self._registered, self.database_id, self.source.member_id)
        return unknown, view.settled

    def _goes_on(self) -> bool:
        """Established, or another established worker of this database is in the group (as last looked)."""
        return self.established or established_in_group(self._registered, self._members, self.member)

    def _wait(self, unknown: list[GroupMember], settled: bool, joins: int) -> list[GroupMember]:
        """Before refusing: look again while the group rebalances (an unknown member may be leaving),
        and while a member may still be registering (``client_id`` set), for at most
        :data:`REGISTRATION_GRACE_S`, or until a newer assignment comes."""
        deadline = self._clock() + REGISTRATION_GRACE_S
        while (unknown and (not settled or self.settings.client_id) and self._clock() < deadline
               and self.source.joins == joins):
            self._sleep(GRACE_RECHECK_S)
            unknown, settled = self._look()
        return unknown

    def _suspect(self, unknown: list[GroupMember]) -> None:
        """An established worker goes on: it says so now, or (``client_id`` set: the member may be
        registering) once the member has stayed unknown for the grace."""
        now = self._clock()
        for m in unknown:
            self._suspects.setdefault(m.member_id, now)
        self._report(unknown, now)

    def _report(self, unknown: list[GroupMember], now: float) -> None:
        due = [m for m in unknown if m.member_id not in self._reported
               and (not self.settings.client_id or now - self._suspects[m.member_id] >= REGISTRATION_GRACE_S)]
        if due:
            log.error("%s of group %r writes to another database than this worker (%s): one pipeline, one "
                      "database; this worker goes on (the group's workers here hold its partitions), stop that one",
                      describe(due), self.group, self.settings.safe_dsn)
            self._reported.update(m.member_id for m in due)

    def _refresh(self) -> None:
        """The periodic refresh of the row; and members still suspected looked at again."""
        try:
            if self._suspects and len(self._reported) < len(self._suspects):
                unknown, _settled = self._look()
                self._report([m for m in unknown if m.member_id in self._suspects], self._clock())
            else:
                self.registry.seen(self.member, claimed=self.established)
                self._next_refresh = self._clock() + REFRESH_S
        except (SQLAlchemyError, KstoreError) as exc:  # the database or the brokers are away: the next one tries again
            self._next_refresh = self._clock() + REFRESH_S
            log.debug("could not refresh worker %s in the registry of group %r: %s", self.member, self.group, exc)
