"""Asking the brokers again while they answer "not now", on either client.

Brokers answer "not now" for a moment after they start, or while leadership moves: the group
coordinator is not available yet or still loading, a partition's leader is elsewhere. Each client
raises those as retriable errors; :class:`Asker` asks again (a debug log line each time) for up to
its patience (``connect_timeout_s`` unless given), and then raises :class:`~kstore.errors.BrokerNotReadyError`
(or at once, for an error that is not transient, :class:`~kstore.errors.BrokerError`): one line for the command.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from kstore.errors import BrokerError, BrokerNotReadyError

log = logging.getLogger(__name__)

#: First and longest wait before asking again after a transient answer (doubling in between).
RETRY_DELAY_S = 0.2
RETRY_MAX_DELAY_S = 2.0

_T = TypeVar("_T")


class Failure(NamedTuple):
    """A client's error, as the asker needs it: the brokers' name for it, and whether asking again may help."""

    reason: str
    retriable: bool


class Asker:
    """Asks a question of the brokers through one client, again after transient answers.

    ``classify`` turns that client's exception into a :class:`Failure` (None: not the client's,
    raised as it is); ``recover`` runs before asking again after a failure (a client that keeps the
    coordinator it found is made anew, say).
    """

    def __init__(self, where: str, patience_s: float, classify: Callable[[Exception], Failure | None], *,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.where, self.patience_s, self.classify = where, patience_s, classify
        self._sleep, self._clock = sleep, clock

    def __call__(self, what: str, question: Callable[[], _T],
                 recover: Callable[[Exception], None] | None = None) -> _T:
        """``question()``, asked again after a transient answer until the patience has passed."""
        deadline = self._clock() + self.patience_s
        delay = RETRY_DELAY_S
        while True:
            try:
                return question()
            except BrokerError:
                raise
            except Exception as exc:
                failure = self.classify(exc)
                if failure is None:
                    raise
                if not failure.retriable:
                    raise BrokerError(f"Kafka at {self.where} could not {what}: {failure.reason}") from None
                if self._clock() + delay > deadline:
                    if self.patience_s <= 0:
                        raise BrokerNotReadyError(f"Kafka at {self.where} could not {what}: {failure.reason}") from None
                    raise BrokerNotReadyError(f"Kafka at {self.where} could not {what} within {self.patience_s:g}s "
                                              f"(connect_timeout_s): still {failure.reason}") from None
                # Debug: a command that succeeds in the end prints nothing on stderr; one that does not,
                # its one line (--log-level DEBUG shows each try).
                log.debug("Kafka at %s cannot %s yet (%s): asking again in %.1fs", self.where, what, failure.reason,
                          delay)
                self._sleep(delay)
                delay = min(delay * 2, RETRY_MAX_DELAY_S)
                if recover is not None:
                    recover(exc)
