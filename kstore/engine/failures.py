"""The engine's retry bookkeeping: attempts per message, the isolation window, the next attempt's time;
and the dead-letter breaker (:class:`Breaker`): how many messages in a row were dead-lettered.

A failed batch of several messages is retried in batches half as large, from one partition
at a time, until the failing message runs alone; then it is attempted under the processor's
:class:`~kstore.retry.RetryPolicy` (backoff, ``max_attempts``, final errors) and, exhausted,
dead-lettered or the worker stops (the strategies of :mod:`kstore.engine.strategies` decide, this only counts).
Used on the worker's main thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from kstore.db.sqlerrors import error_text
from kstore.retry import Failure, Retry, RetryPolicy
from kstore.types import Record
from kstore.types import TopicPartition as TP

#: A message by plain values: (topic, partition, offset).
MessageKey = tuple[str, int, int]


class Failures:
    """Attempts per message, the isolation window, and when the next attempt may run."""

    def __init__(self, policy: RetryPolicy, statement_parameters: bool = False) -> None:
        self.policy = policy
        #: ``log_statement_parameters``: log lines give a failure whole, with the values a statement carried.
        self.statement_parameters = statement_parameters
        self._failures: dict[MessageKey, Failure] = {}
        #: Per partition, the last offset of a failed multi-message batch: until the worker
        #: is past it, batches are smaller, so the failing message is found and retried alone.
        self._isolating: dict[TP, int] = {}
        #: Batch size while isolating: halved on each failed batch, doubled on each commit,
        #: so a bad message in a batch of n is found in about log2(n) transactions and
        #: the good ones around it still commit in large batches.
        self._isolation_size = 1
        self.not_before = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.not_before

    @property
    def active(self) -> bool:
        """Whether any message is failing or being isolated (else :meth:`done` has nothing to do)."""
        return bool(self._failures or self._isolating)

    def focus(self, has_records: Callable[[TP], bool]) -> TP | None:
        """While isolating: the partition to take the next batch from, alone.

        A failed batch may hold several partitions; isolation batches take from one
        of them at a time, so halving pins the failure to a message of that partition.
        (Taken across partitions, a poison message at the head of one partition next to
        another's backlog would ride along in every halved batch and never be tried alone.)
        """
        return next((tp for tp in self._isolating if has_records(tp)), None)

    def batch_size(self, normal: int) -> int:
        return min(self._isolation_size, normal) if self._isolating else normal

    def batch_failed(self, keys: list[MessageKey]) -> None:
        """A batch of several messages failed: isolate them, in batches half as large (no attempt counted)."""
        for t, p, o in keys:
            self._isolating[(t, p)] = max(o, self._isolating.get((t, p), -1))
        self._isolation_size = max(1, len(keys) // 2)

    def message_failed(self, key: MessageKey, exc: BaseException) -> Failure:
        """Count an attempt; schedule the next one unless the policy is exhausted."""
        failure = self._failures.setdefault(key, Failure())
        failure.record(exc, self.describe(exc))
        if self.policy.gives_up_on(exc):
            failure.final = True
        elif failure.attempts < self.policy.max_attempts:
            delay = exc.delay if isinstance(exc, Retry) and exc.delay is not None else self.policy.delay(
                failure.attempts)
            self.not_before = time.monotonic() + delay
        return failure

    def describe(self, exc: BaseException) -> str:
        """An error for a log line: one line, without the statement's values unless ``statement_parameters``."""
        return error_text(exc, self.statement_parameters)

    def exhausted(self, failure: Failure) -> bool:
        return failure.final or failure.attempts >= self.policy.max_attempts

    def isolating(self, tp: TP) -> bool:
        """Whether a failed batch of this partition is being narrowed down."""
        return tp in self._isolating

    def done(self, keys: list[MessageKey]) -> None:
        """These messages are committed (or dead-lettered): forget them, and end isolation past them."""
        for t, p, o in keys:
            self._failures.pop((t, p, o), None)
            last = self._isolating.get((t, p))
            if last is not None and o >= last:
                del self._isolating[(t, p)]
        self._isolation_size *= 2
        if not self._isolating:
            self._isolation_size = 1

    def retain(self, owned: Collection[TP]) -> None:
        """Forget failures and isolation of partitions this worker no longer delivers."""
        if self._failures or self._isolating:
            self._failures = {k: f for k, f in self._failures.items() if (k[0], k[1]) in owned}
            self._isolating = {tp: o for tp, o in self._isolating.items() if tp in owned}


class Breaker:
    """Messages dead-lettered in a row with no message handled in between, counted apart by kind.

    A crash (a message that failed every attempt with an error the processor did not mean) and a
    rejection (``Reject``, an error of ``give_up_on``, a message that cannot be deserialized) are
    counted apart, each against its own limit (0: none): the processor rejecting many messages in
    a row says the messages are bad, and costs nothing; every message crashing says the processor
    is. Any message handled (committed) ends both runs.
    """

    def __init__(self, max_crashes: int, max_rejects: int) -> None:
        self.limits = {"crashed": max_crashes, "rejected": max_rejects}
        self.runs = {"crashed": 0, "rejected": 0}
        self.last: tuple[Record, Failure] | None = None

    def committed(self, records: Sequence[Record], letters: Sequence[tuple[Record, Failure]]) -> str | None:
        """A batch of ``records`` committed, ``letters`` among them dead-lettered. Returns why the
        breaker trips, or None."""
        if not letters:
            if records:
                self.runs = {"crashed": 0, "rejected": 0}
            return None
        lettered = {(r.topic, r.partition, r.offset): failure for r, failure in letters}
        tail: list[tuple[Record, Failure]] = []  # the letters after the batch's last handled message
        for record in reversed(records):
            failure = lettered.get((record.topic, record.partition, record.offset))
            if failure is None:
                self.runs = {"crashed": 0, "rejected": 0}
                break
            tail.append((record, failure))
        for record, failure in reversed(tail):
            self.runs["rejected" if failure.final else "crashed"] += 1
            self.last = (record, failure)
        return self._tripped()

    def _tripped(self) -> str | None:
        for kind, setting in (("crashed", "max_consecutive_dead_letters"), ("rejected", "max_consecutive_rejects")):
            limit, run = self.limits[kind], self.runs[kind]
            if limit and run >= limit and self.last is not None:
                record, failure = self.last
                what = ("failed every attempt" if kind == "crashed" else "were rejected (Reject, give_up_on, "
                        "or not deserializable)")
                return (f"{run} messages in a row {what} and were dead-lettered, none handled in between "
                        f"({setting}={limit}); the last: {record.topic}[{record.partition}] offset {record.offset}: "
                        f"{failure.logged}")
        return None
