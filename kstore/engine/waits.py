"""Waiting out an outage a batch met: :class:`OutageWait` for one outside the database, and
:class:`Outages`, every outage a batch may meet and the probe that tells one from a batch's own failure.

A topic the processor produces to that the cluster does not have (not created yet, or deleted
while the worker runs), or a schema registry that does not answer, is an outage, like a database
that does not answer: the batch is rolled back and put back, nothing is dead-lettered, and it is
tried again after a backoff. Whether a missing topic exists again is asked of the brokers at most
every ``topic_recheck_s`` (see :class:`kstore.kafka.seam.PartitionCounts`), so the backoff only
spaces the attempts.

A batch that fails with a database error again after the database answered in between (the probe
before its retry) is not meeting an outage but causing its error: :meth:`Outages.waited` says so,
and the batch's failure strategy decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from kstore.db.sqlerrors import database_state, first_line, transient
from kstore.errors import MissingTopicError, RegistryUnavailableError
from kstore.telemetry.metrics import Metrics

from .backoff import Backoff
from .failures import MessageKey

log = logging.getLogger(__name__)
#: The batches' logger: a batch's database error taken as its own failure is the batch's line, as it always was.
_batches_log = logging.getLogger("kstore.engine.batches")

#: First and longest wait before a batch that met an outage is tried again.
RETRY_DELAY = 0.5
RETRY_MAX_DELAY = 10.0


class OutageWait:
    """The backoff of batches that met one kind of outage, and what /readyz says meanwhile."""

    def __init__(self, metrics: Metrics, reason: str, back: str) -> None:
        self._metrics = metrics
        #: The label of ``kstore_batches_rolled_back_total`` the attempts count under.
        self._reason = reason
        #: Said once the outage is over.
        self._back = back
        self._delay = RETRY_DELAY
        self.not_before = 0.0
        #: Why batches wait (the error's text), from a batch that met the outage to one that committed.
        self.missing: str | None = None

    def ready(self) -> bool:
        return time.monotonic() >= self.not_before

    def failed(self, exc: Exception) -> None:
        """A batch was rolled back for the outage: said once (then at DEBUG), and waited out."""
        self._metrics.rolled_back(self._reason)
        delay = self._delay
        self._delay = min(self._delay * 2, RETRY_MAX_DELAY)
        self.not_before = time.monotonic() + delay
        text = str(exc)
        (log.debug if text == self.missing else log.warning)(
            "%s; the batch was rolled back and waits (nothing is dead-lettered); retrying in %.1fs", text, delay)
        self.missing = text

    def succeeded(self) -> None:
        if self.missing is not None:
            log.info("%s: processing again", self._back)
        self.missing = None
        self._delay = RETRY_DELAY
        self.not_before = 0.0


class Outages:
    """The outages batches wait out: the database (the backoff shared with the worker's claims and
    checks), a missing output topic and the schema registry; never a message's failure."""

    def __init__(self, metrics: Metrics, db: Backoff) -> None:
        self._metrics = metrics
        self.db = db
        #: A topic the processor produces to is missing: batches wait for it, as for the database.
        self.topic = OutageWait(metrics, "missing_topic", "the output topic is back")
        #: The schema registry does not answer (reading a record's schema, or producing with one): the same.
        self.registry = OutageWait(metrics, "schema_registry", "the schema registry answers again")
        #: The first message of the batch that last failed with a database error, and whether the
        #: database has answered since (a probe before the batch's next attempt): see :meth:`waited`.
        self._db_failed: tuple[MessageKey, bool] | None = None

    def ready(self) -> bool:
        return self.db.ready() and self.topic.ready() and self.registry.ready()

    @property
    def not_before(self) -> float:
        return max(self.db.not_before, self.topic.not_before, self.registry.not_before)

    def succeeded(self) -> None:
        """A batch's transaction answered: every outage is over."""
        self.db.succeeded()
        self.topic.succeeded()
        self.registry.succeeded()

    def committed(self) -> None:
        """A batch committed: a database error of the batch before it was an outage after all."""
        self._db_failed = None

    def waited(self, first: MessageKey, cause: BaseException, what: str) -> bool:
        """Whether ``cause``, which a batch starting at ``first`` met, is an outage: then it is counted
        and backed off, and the batch is retried as it is. False: the batch's own failure.

        No batch is retried at the same size forever: one that fails with a database error
        again after the database answered in between (the probe before its retry, see
        :meth:`probe`) is not meeting an outage but causing its error (a statement longer
        than the deadline, a session the server ends for idling inside it): that is the
        batch's failure, narrowed down to a message and counted against it by policy.
        """
        if isinstance(cause, MissingTopicError):  # an outage too, never a message's fault: waited out
            self.topic.failed(cause)
            return True
        if isinstance(cause, RegistryUnavailableError):  # the same
            self.registry.failed(cause)
            return True
        if not transient(cause):
            return False
        if self._db_failed == (first, True) and not database_state(cause):
            self._db_failed = None
            _batches_log.warning("%s failed again (%s) though the database answered in between: not an outage; "
                                 "taken as a failure of the batch's messages", what, first_line(cause))
            self.db.succeeded()
            return False
        self._db_failed = (first, False)
        self._metrics.rolled_back("database")
        self.db.failed(what, cause)
        return True

    def probe(self, first: MessageKey, select_one: Callable[[], None]) -> bool:
        """Before the retry of a batch that failed with a database error: does the database answer
        now (``select_one``, on a fresh connection)? False (a backoff is set) if it does not: an outage.
        Nothing is asked for any other batch."""
        if self._db_failed is None:
            return True
        key, answered = self._db_failed
        if key != first:
            self._db_failed = None
            return True
        if answered:
            return True
        try:
            select_one()
        except SQLAlchemyError as exc:
            self.db.failed("reach the database", exc)
            return False
        self._db_failed = (key, True)
        return True
