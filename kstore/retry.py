"""Retrying a failing message: the policy, the ``Retry`` exception, and the bookkeeping.

A batch that raises is rolled back. The worker then processes the messages of
that batch one per transaction ("isolation"), so the good ones commit and the
failing one is retried alone, with exponential backoff and jitter, up to
``max_attempts``. After the last attempt the processor's ``on_error`` decides:
``"dead_letter"`` writes it to ``kstore_dead_letters`` in the same transaction
that moves the offset past it; ``"stop"`` stops the worker with the offset
still before it. A message is never silently skipped.
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone

TP = tuple[str, int]
MessageKey = tuple[str, int, int]


class Retry(Exception):
    """Raise from ``handle``/``handle_batch`` to ask for a later attempt (counts as one attempt).

    ``delay`` (seconds) overrides the policy's backoff for this attempt.
    """

    def __init__(self, message: str = "retry requested", delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class Reject(Exception):
    """Raise from ``handle``/``handle_batch`` for a message that can never succeed (invalid,
    unparseable, refused by a rule): it is not retried. At once, with no backoff, it is
    dead-lettered (``on_error="dead_letter"``) or stops the worker (``"stop"``).
    """


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failing message is retried."""

    max_attempts: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    #: Each delay is scaled by a random factor in [1 - jitter, 1 + jitter], so that
    #: workers failing together do not retry in lockstep.
    jitter: float = 0.2
    #: Exceptions that are never retried, like :class:`Reject` (always included): e.g.
    #: ``(ValueError, KeyError)`` for a processor whose parsing errors are final.
    give_up_on: tuple[type[BaseException], ...] = ()

    def gives_up_on(self, exc: BaseException) -> bool:
        """Whether ``exc`` is final: the message is not attempted again."""
        return isinstance(exc, (Reject, *self.give_up_on))

    def delay(self, attempts: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after ``attempts`` failed attempts (1 = the first failure)."""
        base = min(self.backoff_s * self.multiplier ** max(0, attempts - 1), self.max_backoff_s)
        spread = (rng or random).uniform(1 - self.jitter, 1 + self.jitter)
        return max(0.0, base * spread)


@dataclass
class Failure:
    """What is known about one failing message."""

    attempts: int = 0
    first_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    last_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    error: str = ""
    traceback: str = ""
    #: The last error was final (:class:`Reject`, or one the policy gives up on): no more attempts.
    final: bool = False

    def record(self, exc: BaseException) -> None:
        self.attempts += 1
        self.last_at = datetime.now(timezone.utc)
        self.error = f"{type(exc).__name__}: {exc}"
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


class Failures:
    """Attempts per message, the isolation window, and when the next attempt may run."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._failures: dict[MessageKey, Failure] = {}
        #: Per partition, the last offset of a failed multi-message batch: until the worker
        #: is past it, batches are smaller, so the failing message is found and retried alone.
        self._isolating: dict[TP, int] = {}
        #: Batch size while isolating: halved on each failed batch, doubled on each commit,
        #: so a bad message in a batch of n is found in about log2(n) transactions and
        #: the good ones around it still commit in large batches.
        self._isolation_size = 1
        self._not_before = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._not_before

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
        failure.record(exc)
        if self.policy.gives_up_on(exc):
            failure.final = True
        elif failure.attempts < self.policy.max_attempts:
            delay = exc.delay if isinstance(exc, Retry) and exc.delay is not None else self.policy.delay(
                failure.attempts)
            self._not_before = time.monotonic() + delay
        return failure

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
