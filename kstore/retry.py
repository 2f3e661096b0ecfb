"""Retrying a failing message: the policy, the ``Retry`` and ``Reject`` exceptions (and the two
rejections kstore raises itself, :class:`ProduceError` and :class:`DeserializationError`), and a
failure's record.

What a processor configures and raises. The engine applies it (:mod:`kstore.engine.failures`):
a batch that raises is rolled back. The worker then retries it in batches half as
large (doubling again after each commit) until the failing message is alone
("isolation"), so the good ones commit and the failing one is retried alone, with
exponential backoff and jitter, up to
``max_attempts``. After the last attempt the processor's ``on_error`` decides:
``"dead_letter"`` writes it to ``kstore_dead_letters`` in the same transaction
that moves the offset past it; ``"stop"`` stops the worker with the offset
still before it. A message is never silently skipped.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone


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


class ProduceError(Reject):
    """A record given to :meth:`~kstore.Processor.produce` can never be published (a value that cannot be
    serialized, a partition its topic does not have, a record over the size limit). A topic the
    cluster does not have is not one of these: that is an outage (:class:`~kstore.MissingTopicError`).

    A :class:`Reject`: the message that produced it is not retried but, by
    ``on_error``, dead-lettered at once (nothing it produced is published) or stops the worker.
    """


class DeserializationError(Reject):
    """A record's key or value could not be deserialized (:meth:`~kstore.Processor.deserialize` raised, e.g. a
    value that is not JSON with ``value_format = "json"``); the original error is its cause.

    A :class:`Reject`, attributed to that one message without running its batch:
    by ``on_error``, it is dead-lettered at once, in the transaction of the rest of its batch, or
    the worker stops with the offset just before it. (A custom ``deserialize`` that raises
    :class:`Retry` fails its batch instead, which is retried as any failing batch.)
    """

    @classmethod
    def of(cls, exc: Exception) -> DeserializationError:
        error = cls(f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error


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


def one_line(exc: BaseException) -> str:
    """An error as a log line gives it: its type and the first line of its message. The further
    lines of a database error hold the statement and the values bound to it, a message's contents."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@dataclass
class Failure:
    """What is known about one failing message."""

    attempts: int = 0
    first_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    last_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    #: The whole error, as the dead letter keeps it (in the database, beside the message).
    error: str = ""
    #: The error as log lines and the worker's messages give it: :func:`one_line` unless told otherwise.
    logged: str = ""
    traceback: str = ""
    #: The last error was final (:class:`Reject`, or one the policy gives up on): no more attempts.
    final: bool = False
    #: The last error's class, by its full name (``module.Class``), and its message.
    kind: str = ""
    message: str = ""

    def record(self, exc: BaseException, logged: str | None = None) -> None:
        self.attempts += 1
        self.last_at = datetime.now(timezone.utc)
        self.kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.message = str(exc)
        self.error = f"{type(exc).__name__}: {exc}"
        self.logged = one_line(exc) if logged is None else logged
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
