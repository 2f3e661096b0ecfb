"""The exceptions kstore raises to its users.

Every error a user or operator can cause (bad configuration, a database that
is not there, a topic that does not exist) is a :class:`KstoreError`; the CLI
prints its message on one line and exits non-zero, without a traceback unless
``--debug`` is given.
"""

from __future__ import annotations


class KstoreError(Exception):
    """Base class for every error kstore reports to a user."""

    exit_code = 2


class ConfigurationError(KstoreError):
    """A setting is missing, malformed or names something that does not exist."""


class DatabaseError(KstoreError):
    """The database cannot be reached or is not in the state kstore needs."""


class NotMigratedError(DatabaseError):
    """kstore's tables are missing or at an older migration."""


class BrokerError(KstoreError):
    """The Kafka brokers cannot be reached or refused a request."""


class BrokerNotReadyError(BrokerError):
    """The brokers answered "not now" (a retriable answer: a coordinator still loading, a leader moving,
    the brokers away) until the question's patience ran out: asked later, it may well be answered."""


class MissingTopicError(BrokerError):
    """A topic the processor produces to is not in the cluster (not created yet, or deleted).

    An outage, never the message's fault: the batch is rolled back and retried after a backoff
    until the topic exists (``topic_recheck_s``); nothing is dead-lettered. At a worker's start, a
    declared output topic that is missing is a configuration error instead (one line, exit 2).
    """


class RegistryUnavailableError(KstoreError):
    """The schema registry cannot be reached, timed out, refused kstore's credentials or answered
    with a server error.

    An outage, never the message's fault: a batch that met it is rolled back and retried after a
    backoff, and nothing is dead-lettered (``/readyz`` says why meanwhile). At a worker's start, a
    registry that does not answer is an error instead (one line, exit 2).
    """

    exit_code = 2


class InvalidOffsetError(KstoreError):
    """A reset target lies outside the partition's log (raised in strict mode)."""


class ProcessorError(KstoreError):
    """The processor raised while handling a batch; nothing of it was committed."""

    exit_code = 1


class TooManyDeadLettersError(ProcessorError):
    """The dead-letter breaker tripped (``dead_letter_breaker="stop"``): too many messages in a row
    were dead-lettered with none handled in between (``max_consecutive_dead_letters``,
    ``max_consecutive_rejects``). The dead letters written so far are committed; the worker stops
    before the next message."""


class ProcessorContractError(ProcessorError):
    """The processor did what kstore can never commit correctly, whatever the message: a hook
    returned a coroutine (it never ran), or the batch's own transaction was ended inside it.

    The worker stops, whatever ``on_error`` says: every message would fail the same way, and
    dead-lettering them would fill the dead letters with good messages.
    """


class UndeclaredTopicError(ProcessorContractError):
    """``produce()`` to a topic missing from the processor's ``produces``: a programming error.

    The worker stops (nothing of the batch commits, nothing is dead-lettered): every message would
    produce to it the same way. Add the topic to ``produces``, or fix its name.
    """


class OutboxBusyError(KstoreError):
    """An outbox cannot be resharded now: records wait in it, or its relays run. Drain it (stop the
    application's writes, let the relays publish what waits), stop its relays, and try again."""


class OutboxChangedError(KstoreError):
    """An outbox's shards were made anew (``kstore outbox reshard``) since this process read them: a
    write counting by the old number is rolled back, and a relay sharing the old lanes stops (start it
    again). An application's :class:`~kstore.outbox.Outbox` reads the new shards at its next write."""


class FencedError(KstoreError):
    """This worker no longer owns a partition: another worker (or an admin) claimed it."""


class CommitInDoubtError(KstoreError):
    """A write's COMMIT failed without an answer and reading it back failed too: it may or may not have landed.

    Its message says what to check before trying again (``kstore offsets history``
    for a reset, ``kstore dead-letters show`` for a replay). A distinct exit code,
    so that a script never retries it blindly.
    """

    exit_code = 3


class WriteCountError(KstoreError):
    """A write kstore rewrote for speed reported another number of rows than kstore sent.

    A multi-row INSERT of n rows must report n, a COPY of n rows n, a page of k statements
    must show that all k ran. Anything else fails the batch before its commit: rows would
    otherwise have been lost (or doubled) while the offsets moved on. The one legitimate
    cause is the table's own: a ``BEFORE INSERT`` trigger that returns NULL, or a rule, drops
    rows on purpose; a processor writing to such a table sets ``defer_inserts = False`` (and
    writes it without ``copy_rows``).
    """

    exit_code = 1
