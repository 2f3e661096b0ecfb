"""The simulated world of one schedule: a cluster, a group, a database, a clock and
up to a few real :class:`kstore.Worker` objects driven one turn at a time (a worker's
threads interleave at the preemption points of :mod:`.threads`).
"""

from __future__ import annotations

import contextlib
import random
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from kstore import KstoreError, Settings, Worker
from kstore.db.store import Store
from kstore.engine.partitions import Partitions
from kstore.kafka.clients import SourceFactory
from kstore.kafka.stub import DeferringStubSource, StubCluster, StubMember, StubSource

from .clock import SimClock, SimCondition
from .db import Databases
from .invariants import JournalCheck, Violation, check_final
from .processor import GROUP, POISON, SimProcessor
from .threads import CALLER, FETCHER, MAIN, PreemptingLock, Threads

TP = tuple[str, int]
LIVE, PAUSED, DEAD, CLOSED = "live", "paused", "dead", "closed"
FAULT_KINDS = ("lost_answer", "fail_commit", "fail_statement", "down")
#: The stub's consumer for each client's threading: kafka-python's (rebalance callbacks may run on
#: its IO thread between the fetcher's turns, queued for the fetcher) and confluent-kafka's (only
#: inside a fetch, applied there at once; seeks and pauses carried out by the next fetch).
CLIENTS: dict[str, type[StubSource]] = {"kafka-python": StubSource, "confluent": DeferringStubSource}


@dataclass(frozen=True)
class Config:
    """The shape of one schedule's world (drawn from its seed)."""

    partitions: dict[str, int]
    slots: int
    max_batch_size: int
    max_poll_records: int
    max_buffered_bytes: int
    preempt: float
    resets: bool
    faults: frozenset[str]
    #: Violation kinds that do not stop the schedule: a crash kills the worker instead.
    tolerate: frozenset[str] = frozenset()
    #: Drain under a steady stream first while poison is pending (the livelock check).
    steady: bool = True
    #: What the run left out (see schedule.OPTIONAL), for replays.
    skip: frozenset[str] = frozenset()
    #: Whose threading the workers' consumers have (see :data:`CLIENTS`).
    client: str = "kafka-python"


@dataclass
class Member:
    """One Worker object (a process) in a slot; a restart puts a new Member in the slot."""

    name: str
    slot: int
    world: World
    worker: Worker
    state: str = LIVE
    #: Its consumer's state in the group (the stub's member), once its source is made.
    consumer: StubMember | None = None
    #: Epoch of each partition of the last batch taken (None: not owned when taken).
    taken: dict[TP, int | None] = field(default_factory=dict)
    #: Whether the last step committed a batch.
    committed: bool = False
    #: A reset_offsets (partition index, fraction of the log) another thread makes during a batch.
    armed_reset: tuple[int, float] | None = None

    @property
    def in_group(self) -> bool:
        return self.consumer is not None and self.consumer in self.world.group.members

    # The worker's parts, or None before it connected and after it closed (its public
    # properties raise instead). Read for the checks and the reports only.

    @property
    def source(self) -> Any:
        return self.worker._source

    @property
    def partitions(self) -> Any:
        return self.worker._state

    @property
    def ledger(self) -> Any:
        return self.worker._ledger

    @property
    def batches(self) -> Any:
        return self.worker._batches


class _Crashed(BaseException):
    """A worker crashed inside a nested turn; unwinds the outer turn of the same worker."""


class World:
    def __init__(self, seed: int, cfg: Config, template: Path, directory: Path) -> None:
        self.seed = seed
        self.cfg = cfg
        self.rng = random.Random(seed * 7919 + 17)  # the world's own choices (fetch sizes, preemption...)
        self.clock = SimClock()
        # The stub's choices (the assignor's order, fetch sizes, a zombie's last fetches) are the world's.
        self.cluster = StubCluster(clock=self.clock.time, rng=self.rng, blocking=False)
        for topic, n in cfg.partitions.items():
            self.cluster.create_topic(topic, n)
        self.group = self.cluster.group(GROUP)
        self.trace: list[str] = []
        self.threads = Threads(self.rng, cfg.preempt, self._live, self.trace)
        self.cluster.preemption = self.threads
        self.db = Databases(template, directory / f"sim-{seed}.db", on_statement=self.threads.at_statement,
                            rng=self.rng, trace=self.trace)
        self.slots: list[Member | None] = [None] * cfg.slots
        self.members: dict[str, Member] = {}
        self.journal = JournalCheck(self.cluster.start, self._worker_id)
        self.poison: set[tuple[TP, int]] = set()
        #: How often each poison message was delivered (alone, with others).
        self.poison_tries: dict[tuple[TP, int], list[int]] = {}
        self.crashes: list[str] = []
        self.delivered = 0
        self.had_resets = False
        self._spawned = 0
        op_settings = Settings(dsn=self.db.dsn)
        self.operator = Store(self.db.make_engine(op_settings), op_settings)
        self.source_class = _source_class(self)
        self.partitions_class = _partitions_class(self)

    # -- plumbing -------------------------------------------------------------------

    def _worker_id(self, label: str) -> str | None:
        member = self.members.get(label)
        return None if member is None else member.worker.worker_id

    def note_take(self, name: str, tps: list[TP]) -> None:
        member = self.members[name]
        owned = member.ledger.owned if member.ledger is not None else {}
        member.taken = {tp: (owned[tp].epoch if tp in owned else None) for tp in tps}

    def member(self, slot: int, *states: str) -> Member | None:
        m = self.slots[slot] if slot < len(self.slots) else None
        return m if m is not None and m.state in states else None

    def live(self) -> list[Member]:
        return [m for m in self.slots if m is not None and m.state == LIVE]

    def _live(self, name: str) -> Member | None:
        m = self.members.get(name)
        return m if m is not None and m.state == LIVE and m.source is not None else None

    def _run(self, m: Member, what: str, fn: Callable[[], Any], thread: str = MAIN,
             expected: tuple[type[Exception], ...] = (), nested: bool = False) -> Exception | None:
        """Run one turn of a worker's thread; returns an ``expected`` exception it raised; any other is a crash."""
        try:
            with self.threads.running(m.name, thread):
                fn()
        except (Violation, _Crashed):
            raise
        except expected as exc:
            return exc
        except Exception as exc:
            self._crash(m, what, exc, nested)
        return None

    def _crash(self, m: Member, what: str, exc: Exception, nested: bool) -> None:
        where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:])
        message = f"{m.name} crashed in {what}: {type(exc).__name__}: {exc}\n{where}"
        if "crash" not in self.cfg.tolerate:
            raise Violation("crash", message)
        self.crashes.append(message)
        self.trace.append(f"  CRASH {m.name}: {type(exc).__name__}: {exc}")
        m.state = DEAD
        if nested:
            raise _Crashed(message)

    def fetch_turn(self, m: Member, nested: bool = False) -> None:
        what = "fetch_once" + (" (preempting)" if nested else "")
        self._run(m, what, m.worker.fetch_once, FETCHER, nested=nested)

    def step_turn(self, m: Member, nested: bool = False) -> bool:
        """One turn of the main loop; True if it committed a batch."""
        m.committed = False
        what = "step" + (" (preempting)" if nested else "")
        self._run(m, what, lambda: setattr(m, "committed", m.worker.step()), nested=nested)
        return m.committed

    def check(self) -> None:
        """After every action: the journal's new transactions, and no transaction left open."""
        self.db.settle()  # a COMMIT still in flight lands before the action ends
        self.journal.feed(self.db.journal())
        self.journal.finish_action()
        if self.db.write_locked():
            raise Violation("journal", "a transaction holds the write lock between turns")

    # -- actions ----------------------------------------------------------------------

    def act(self, what: str, fn: Callable[[], Any]) -> None:
        self.trace.append(what)
        with contextlib.suppress(_Crashed):  # a tolerated crash: the worker is dead, the schedule goes on
            fn()
        self.check()
        self.journal.expected_resets.clear()

    def poison_tried(self, tp: TP, offset: int, alone: bool) -> None:
        self.poison_tries.setdefault((tp, offset), [0, 0])[0 if alone else 1] += 1

    def produce(self, tp: TP, n: int, poison: bool) -> None:
        for i in range(n):
            bad = poison and i == 0
            value = (POISON if bad else b"ok") + f"-{tp[1]}-{self.cluster.end(tp)}".encode()
            offset = self.cluster.produce(tp[0], tp[1], value, headers=[("sim", b"1")])
            if bad:
                self.poison.add((tp, offset))

    def spawn(self, slot: int) -> Member | None:
        self._spawned += 1
        name = f"w{slot}" if self._spawned <= self.cfg.slots else f"w{slot}.{self._spawned}"
        cfg = self.cfg
        settings = Settings(
            dsn=self.db.dsn, bootstrap_servers="sim:9092", group=GROUP, topics=tuple(cfg.partitions),
            client_id=name, max_batch_size=cfg.max_batch_size, max_poll_records=cfg.max_poll_records,
            batch_linger_ms=0, poll_timeout_ms=50, max_buffered_bytes=cfg.max_buffered_bytes,
            session_timeout_ms=10_000, epoch_check_interval_s=1.0,
        )
        processor = SimProcessor()
        worker = Worker(processor, settings)
        worker.source_factory = self.source_class
        worker.partitions_factory = self.partitions_class
        m = Member(name, slot, self, worker)
        processor.member = m
        self.members[name] = m
        refused = self._run(m, "start", worker.start, expected=(KstoreError,))
        if refused is not None:  # e.g. the database is down: the process exits
            self.trace.append(f"  {name} did not start: {refused}")
            m.state = CLOSED
            return None
        if m.state == LIVE:
            self.slots[slot] = m
        return m

    def fetch(self, slot: int) -> None:
        m = self.member(slot, LIVE)
        if m is not None:
            self.fetch_turn(m)

    def step(self, slot: int) -> bool:
        """One turn of a worker's main loop; True if it committed a batch."""
        m = self.member(slot, LIVE)
        return m is not None and self.step_turn(m)

    def leave(self, slot: int) -> None:
        m = self.member(slot, LIVE)
        if m is not None:
            self._run(m, "close", m.worker.close)
            m.state = CLOSED
            self.slots[slot] = None

    def restart(self, slot: int) -> None:
        if self.member(slot, LIVE) is not None:
            self.leave(slot)
            self.spawn(slot)

    def kill(self, slot: int) -> None:
        m = self.member(slot, LIVE, PAUSED)
        if m is not None:
            m.state = DEAD

    def pause(self, slot: int) -> None:
        m = self.member(slot, LIVE)
        if m is not None:
            m.state = PAUSED

    def unpause(self, slot: int) -> None:
        m = self.member(slot, PAUSED)
        if m is not None:
            m.state = LIVE

    def expire(self, slot: int) -> None:
        """A session timeout passes for a paused or dead member: the group expels it."""
        m = self.member(slot, PAUSED, DEAD)
        if m is None:
            return
        self.clock.advance(m.worker.settings.session_timeout_ms / 1000)
        if m.consumer is not None:
            self.cluster.expel(GROUP, m.consumer.member_id)
        if m.state == DEAD:
            self.slots[slot] = None

    def operator_reset(self, tp: TP, fraction: float) -> None:
        to = round(fraction * self.cluster.end(tp))
        self.had_resets = True
        self.operator.reset(GROUP, tp, to, expected_epoch=None, reason="sim: operator reset")

    def worker_reset(self, slot: int, index: int, fraction: float, during_batch: bool = False) -> None:
        """``Worker.reset_offsets`` from another thread of the process: now, between turns, or
        (``during_batch``) at a preemption point of the worker's main thread, lock free."""
        m = self.member(slot, LIVE)
        if m is None:
            return
        if during_batch:
            m.armed_reset = (index, fraction)
        else:
            self.reset_turn(m, index, fraction)

    def reset_turn(self, m: Member, index: int, fraction: float, nested: bool = False) -> None:
        held = m.worker.held_offsets
        if not held:
            return
        tp = sorted(held)[index % len(held)]
        to = round(fraction * self.cluster.end(tp))
        self.had_resets = True
        self.journal.expected_resets.append((m.name, tp, to))  # until the end of the action
        self.trace.append(f"  {m.name}: reset_offsets({tp} -> {to}) from another thread")
        refused = self._run(m, "reset_offsets", lambda: m.worker.reset_offsets({tp: to}, reason="sim: reset"),
                            CALLER, (KstoreError, SQLAlchemyError), nested)
        if refused is not None:  # fenced meanwhile, or the database failed: the caller hears of it
            self.trace.append(f"  reset_offsets refused: {type(refused).__name__}: {refused}")

    def arm(self, slot: int, kind: str) -> None:
        m = self.slots[slot]
        if m is None:
            return
        faults = self.db.faults_of(m.name)
        if kind == "lost_answer":
            faults.lose_commit_answers += 1
        elif kind == "fail_commit":
            faults.fail_commits += 1
        elif kind == "fail_statement":
            faults.fail_statements += 1

    def set_down(self, down: bool) -> None:
        self.db.set_down(down)

    def describe(self) -> list[str]:
        """Each member's state as kstore and the consumer see it (for a failure's report)."""
        lines = [f"group: generation {self.group.generation}, rebalancing {self.group.rebalancing}, members "
                 f"{[c.name for c in self.group.members]}; stored {self.stored()}; "
                 f"log ends { {tp: self.cluster.end(tp) for tp in self.cluster.partitions} }"]
        for m in self.members.values():
            if m.state == CLOSED:
                continue
            lines.append(f"{m.name} ({m.state}, id {m.worker.worker_id}): {_ledger_state(m)}")
            if m.consumer is not None:
                lines.append(f"    consumer: {m.consumer.describe()}")
        return lines

    # -- the end --------------------------------------------------------------------------

    def stored(self) -> dict[TP, int | None]:
        rows = self.db.query("SELECT topic, partition_id, next_offset FROM kstore_offsets WHERE consumer_group = ?",
                             (GROUP,))
        return {(t, p): n for t, p, n in rows}

    def caught_up(self) -> bool:
        stored = self.stored()
        return all(stored.get(tp) == self.cluster.end(tp) for tp in self.cluster.partitions)

    def calm(self) -> None:
        """Faults off; zombies expire and come back; the dead are expelled; someone is alive."""
        self.set_down(False)
        for faults in self.db.faults.values():
            faults.clear()
        for slot, m in enumerate(self.slots):
            if m is not None and m.state in (PAUSED, DEAD):
                self.act(f"expire {m.name}", partial(self.expire, slot))
                self.act(f"unpause {m.name}", partial(self.unpause, slot))
        for m in self.members.values():
            m.armed_reset = None
        if not self.live():
            self.act("join w0", lambda: self.spawn(0))

    def round(self) -> None:
        for slot, m in enumerate(self.slots):
            if m is not None and m.state == DEAD:  # crashed while draining: its session times out
                self.act(f"expire {m.name}", partial(self.expire, slot))
        for m in self.live():
            self.act(f"fetch {m.name}", partial(self.fetch, m.slot))
            for _ in range(4):  # like the worker's loop: step again at once after a commit
                self.act(f"step {m.name}", partial(self.step, m.slot))
                if not m.committed:
                    break
        self.clock.advance(0.25)
        if not self.live():
            self.act("join w0", lambda: self.spawn(0))

    def pending_poison(self) -> set[tuple[TP, int]]:
        """Poison messages still ahead of their partition's stored offset (a reset may have skipped others)."""
        stored = self.stored()
        return {(tp, o) for tp, o in self.poison if o >= (stored.get(tp) or 0)}

    def drain(self) -> None:
        """Faults off: a steady stream while poison is pending (it must be isolated), then catch up."""
        self.trace.append("-- drain")
        self.calm()
        if self.cfg.steady:
            self._steady_stream()
        self._catch_up()
        self.final()

    def _steady_stream(self) -> None:
        """While poison is pending, the other partitions always have a record or two waiting:
        the poison must still be tried alone and dead-lettered (no livelock across partitions).

        The bound allows for the slowest configuration (one record per poll and per batch,
        fetched from a random partition) to work through the backlog ahead of the poison.
        """
        stored = self.stored()
        backlog = sum(self.cluster.end(tp) - (stored.get(tp) or 0) for tp in self.cluster.partitions)
        rounds = 40 + 2 * len(self.cluster.partitions) * backlog
        pending = self.pending_poison()
        self.poison_tries.clear()
        for _ in range(rounds):
            if not pending:
                return
            self._keep_busy({tp for tp, _o in pending})
            self.round()
            pending = self.pending_poison() & pending
        if pending:
            tries = {key: self.poison_tries.get(key, [0, 0]) for key in sorted(pending)}
            how = ("never delivered" if not any(a + b for a, b in tries.values()) else
                   "only delivered with other messages" if not any(a for a, _ in tries.values()) else
                   "delivered alone")
            raise Violation("livelock", f"poison never dead-lettered while other partitions kept receiving "
                                        f"messages: {how}\n(tries alone, with others): {tries} after {rounds} rounds")

    def _keep_busy(self, poisoned: set[TP]) -> None:
        """One more message for each other partition with fewer than two waiting."""
        stored = self.stored()
        for tp in self.cluster.partitions:
            if tp not in poisoned and self.cluster.end(tp) - (stored.get(tp) or 0) < 2:
                self.produce(tp, 1, poison=False)

    def _catch_up(self) -> None:
        limit = 60 + 2 * sum(self.cluster.end(tp) for tp in self.cluster.partitions)
        for _ in range(limit):
            if self.caught_up():
                return
            self.round()
        ends = {tp: self.cluster.end(tp) for tp in self.cluster.partitions}
        raise Violation("stuck", f"not caught up after draining with faults off\n{limit} rounds: "
                                 f"stored {self.stored()}, log ends {ends}")

    def final(self) -> None:
        effects: Counter[tuple[TP, int]] = Counter(
            ((t, p), o) for t, p, o in self.db.query("SELECT topic, partition_id, kafka_offset FROM sim_effects"))
        # Dead-letterings, from the journal: a message failing again while its letter waits adds to that
        # letter (kstore.db.deadletters.write), one row in kstore_dead_letters however many passes.
        dead: Counter[tuple[TP, int]] = Counter(
            ((t, p), o) for t, p, o in self.db.query(
                "SELECT topic, partition_id, new_next FROM sim_journal WHERE kind = 'dead'"))
        ends = {tp: self.cluster.end(tp) for tp in self.cluster.partitions}
        check_final(ends, self.stored(), effects, dead, self.poison, self.journal, self.had_resets)

    def close(self) -> None:
        """Give back the connections a dead or paused worker still holds (its process is gone now),
        then close them all: nothing outlives the schedule (a leak ran out of file descriptors)."""
        for m in self.members.values():
            if m.batches is not None:
                m.batches.close()
        self.db.close()


def _source_class(world: World) -> SourceFactory:
    """The stub's consumer on the world's cluster, with the threading of the schedule's client; the
    member's state is noted for the turns and the reports."""

    class SimSource(CLIENTS[world.cfg.client]):  # type: ignore[misc]
        describes_group = False  # one simulated database: nothing to guard

    def make(settings: Settings, group: str, topics: Sequence[str], worker_id: str) -> StubSource:
        source: StubSource = SimSource(world.cluster, settings, group, topics, worker_id)
        world.members[settings.client_id or "?"].consumer = source.consumer
        return source

    return make


def _partitions_class(world: World) -> type[Partitions]:
    """The partitions' state with the simulation's lock (its waits never block), which notes the
    epochs of each batch taken (the delivery checks need them) and lets the main thread run between
    queueing a fetch and applying its rebalance events."""

    class SimPartitions(Partitions):
        def __init__(self, settings: Settings, source: Any) -> None:
            super().__init__(settings, source)
            self.lock = PreemptingLock(world.threads, settings.client_id or "?")  # type: ignore[assignment]
            self.changed = SimCondition(self.lock, world.clock)  # type: ignore[assignment]

        def queue_fetched(self, *args: Any, **kwargs: Any) -> int:
            queued = super().queue_fetched(*args, **kwargs)
            # The fetcher queued what poll() returned and has not yet applied the rebalance events.
            world.threads.in_poll(self.source.consumer, "after queueing, before applying the rebalance events")
            return queued

        def take_batch(self, *args: Any, **kwargs: Any) -> Any:
            records, ends, counts = super().take_batch(*args, **kwargs)
            world.note_take(self.settings.client_id or "?", sorted(ends))
            self.check()
            return records, ends, counts

    return SimPartitions


def _ledger_state(m: Member) -> str:
    ledger, source = m.ledger, m.partitions
    if ledger is None or source is None:
        return "not connected"
    owned = {f"{t}[{p}]": (o.epoch, o.committed) for (t, p), o in sorted(ledger.owned.items())}
    queues = {f"{t}[{p}]": [r.offset for r in q.records][:6] for (t, p), q in sorted(source.queues().items())}
    failures = getattr(m.batches, "failures", None)
    return (f"owned(epoch, committed) {owned}, pending {sorted(ledger.pending)}, held {ledger.held}, "
            f"fenced_at {ledger.fenced_at}; queues {queues} throttled {source._throttled}; failing "
            f"{list(getattr(failures, '_failures', {}))} isolating {getattr(failures, '_isolating', None)} "
            f"size {getattr(failures, '_isolation_size', None)}")
