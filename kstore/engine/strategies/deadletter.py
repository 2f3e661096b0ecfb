"""Dead-letter (``on_error="dead_letter"``): a message whose attempts are exhausted is written to
``kstore_dead_letters`` in the transaction that moves its offset past it, and its record produced to the
dead-letter topic (if there is one) through the outbox in that same transaction, so the letter and
the move land together or not at all (a lost answer is read back like a batch's).

A message's final error raised before it did anything (``Reject``, ``give_up_on``) and a message that
cannot be deserialized are dead-lettered at once, in the batch's own transaction, which commits the
rest of the batch.

The breaker (:class:`~kstore.engine.failures.Breaker`): too many messages dead-lettered in a row, none
handled in between, stop the worker or pause it (``dead_letter_breaker``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from sqlalchemy import Connection

from kstore.db import deadletters
from kstore.errors import TooManyDeadLettersError
from kstore.retry import Failure
from kstore.running.handler import Outgoing
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics
from kstore.types import Message, Produced, Record

from ..decoding import Decoded
from ..failures import Breaker
from .base import Failed, Instead, Strategy, Verdict, fields

#: The batches' logger: these lines are a batch's, as they always were.
log = logging.getLogger("kstore.engine.batches")


class OutboxWriter(Protocol):
    """Where records produced in a transaction are written (the group's outbox), read by its relay."""

    def write(self, conn: Connection, records: Sequence[Produced]) -> None: ...


class DeadLetter(Strategy):
    """Dead-letters a message that failed every attempt, or that is rejected or cannot be deserialized."""

    sets_aside = True

    def __init__(self, settings: Settings, group: str, metrics: Metrics, outbox: OutboxWriter | None,
                 topic: str | None) -> None:
        self.settings, self.group, self.metrics, self.outbox = settings, group, metrics, outbox
        self._table = deadletters.build_table(settings.table_prefix, settings.schema)
        #: Where each new dead letter is also produced, through the outbox in its transaction (None: nowhere).
        self.topic = topic
        #: Messages dead-lettered in a row; past its limits the worker stops, or pauses (see :meth:`committed`).
        self.breaker = Breaker(settings.max_consecutive_dead_letters, settings.max_consecutive_rejects)

    def failed(self, failed: Failed) -> Verdict | None:
        record, failure = failed.taken.records[0], failed.failure
        assert failure is not None, "a dead letter is written for a message whose attempts were counted"

        def said() -> None:
            log.warning("dead-lettered %s[%d] offset %d after %d attempt(s): %s", record.topic, record.partition,
                        record.offset, failure.attempts, failure.logged, extra=fields(record))

        return Instead("a dead letter", lambda conn: self._write_letter(conn, record, failure), [(record, failure)],
                       self.metrics.dead_lettered, said)

    def _write_letter(self, conn: Connection, record: Record, failure: Failure) -> int:
        """A dead letter alone in its transaction, and its topic's record (if any) in the outbox; returns
        how many records it wrote to the outbox."""
        produced = self._letter(conn, record, failure)
        if produced is None:
            return 0
        assert self.outbox is not None
        self.outbox.write(conn, [produced])
        return 1

    def _letter(self, conn: Connection, record: Record, failure: Failure) -> Produced | None:
        """Write a dead letter in ``conn``'s transaction; its dead-letter topic's record, to produce in that
        transaction, if there is a topic and the letter is new (a letter already waiting for the message
        took the new failure: its record was produced then)."""
        if deadletters.write(conn, self._table, self.group, record, failure) and self.topic:
            return deadletters.topic_record(self.topic, self.group, record, failure)
        return None

    def set_aside(self, conn: Connection, decoded: Decoded, rejects: list[tuple[int, Exception]],
                  letters: list[tuple[Record, Failure]], outgoing: Outgoing | None) -> list[Message]:
        """Final errors raised before the message did anything, and messages that could not be
        deserialized: dead-lettered in this same transaction, which commits the rest of the batch
        and moves past them (in offset order). Returns the messages that were handled."""
        found = [(decoded.records[index], error) for index, error in rejects] + decoded.undecodable
        for record, error in sorted(found, key=lambda item: (item[0].topic, item[0].partition, item[0].offset)):
            failure = Failure(final=True)
            failure.record(error)
            letters.append((record, failure))
            produced = self._letter(conn, record, failure)
            if produced is not None and outgoing is not None:
                outgoing.records.append(produced)  # with the batch's own records, written last before the offsets
        rejected = {index for index, _ in rejects}
        return [m for i, m in enumerate(decoded.msgs) if i not in rejected]

    def set_aside_landed(self, letters: Sequence[tuple[Record, Failure]]) -> None:
        for record, failure in letters:
            self.metrics.dead_lettered()
            log.warning("dead-lettered %s[%d] offset %d at once: %s", record.topic, record.partition,
                        record.offset, failure.logged, extra=fields(record))

    def committed(self, records: Sequence[Record], letters: Sequence[tuple[Record, Failure]]) -> str | None:
        """Past the breaker's limits (see :class:`~kstore.engine.failures.Breaker`), stop the worker, or
        pause it (returns why), by policy."""
        why = self.breaker.committed(records, letters)
        if why is None:
            return None
        if self.settings.dead_letter_breaker == "pause":
            log.error("dead-letter breaker: %s; paused: no more batches until the worker is restarted "
                      "(dead_letter_breaker=pause)", why)
            return why
        raise TooManyDeadLettersError(
            f"{why}; the worker stops (dead_letter_breaker=stop): a processor that fails on every message is more "
            f"likely broken than every message bad. See `kstore dead-letters list --group {self.group}`, fix the "
            "cause, then replay them")
