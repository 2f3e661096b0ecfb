"""The interface of a failure strategy (:class:`Strategy`), what it answers (:data:`AGAIN`, :class:`Instead`)
and the ordered chain of them a worker asks (:class:`Chain`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import ClassVar

from sqlalchemy import Connection

from kstore.retry import Failure
from kstore.running.handler import Outgoing
from kstore.types import Message, Record

from ..decoding import Batch, Decoded


class Again(enum.Enum):
    """Put the batch back in front of its queues: it is taken again (once the strategy's wait is over)."""

    AGAIN = "again"


AGAIN = Again.AGAIN


@dataclasses.dataclass(frozen=True)
class Instead:
    """Commit ``write`` in the batch's place: one transaction that moves the batch's offsets past it,
    without the processor's effects (a dead letter, say). It is committed, fenced or in doubt like
    a batch (:mod:`kstore.engine.commit`)."""

    #: What it is, for log lines ("a dead letter").
    what: str
    #: Its writes, in the transaction; returns how many records it wrote to the outbox.
    write: Callable[[Connection], int]
    #: The messages it dead-letters, with their failures (for the dead-letter breaker).
    letters: Sequence[tuple[Record, Failure]]
    #: Counts it in the metrics once it landed (also when a lost answer is read back as landed).
    count: Callable[[], None]
    #: Its log line, once its COMMIT answered.
    say: Callable[[], None]


#: What a strategy answers for a failed batch.
Verdict = Again | Instead


@dataclasses.dataclass
class Failed:
    """A batch the processor failed on, as the chain's strategies see it one after the other."""

    taken: Batch
    #: The processor's error (or the database's, for a batch that causes its own database error).
    cause: BaseException
    #: A batch of one message: its attempts so far, once a strategy counted this one.
    failure: Failure | None = None


class Strategy:
    """One step of what ``on_error`` does with a processor's failure. The defaults leave everything
    to the other steps of the chain: a strategy overrides what it decides."""

    #: Whether a message's final error raised before it did anything (``Reject``, ``give_up_on``) and a
    #: message that cannot be deserialized are set aside in the batch's own transaction (see
    #: :meth:`set_aside`), so the rest of the batch commits; else they fail the batch.
    sets_aside: ClassVar[bool] = False

    def failed(self, failed: Failed) -> Verdict | None:
        """What becomes of a batch the processor failed on; None leaves it to the next strategy."""
        return None

    def undecodable(self, taken: Batch, decoded: Decoded) -> tuple[Batch, Decoded]:
        """Before the batch's transaction, when some of its messages cannot be deserialized: the batch to run."""
        return taken, decoded

    def set_aside(self, conn: Connection, decoded: Decoded, rejects: list[tuple[int, Exception]],
                  letters: list[tuple[Record, Failure]], outgoing: Outgoing | None) -> list[Message]:
        """Inside the batch's transaction (:attr:`sets_aside` only): the messages of ``rejects`` (index
        in ``decoded.msgs``, error) and ``decoded.undecodable`` set aside, added to ``letters``.
        Returns the messages that were handled."""
        raise NotImplementedError

    def set_aside_landed(self, letters: Sequence[tuple[Record, Failure]]) -> None:
        """The batch that set ``letters`` aside committed."""

    def committed(self, records: Sequence[Record], letters: Sequence[tuple[Record, Failure]]) -> str | None:
        """A transaction of ``records`` committed, ``letters`` among them dead-lettered. Returns why no
        more batches are to be taken (the worker pauses), or None; raises to stop the worker."""
        return None


class Chain:
    """The strategies ``on_error`` names, asked in order: the first that decides on a failure wins."""

    def __init__(self, strategies: Sequence[Strategy]) -> None:
        self.strategies = tuple(strategies)
        self._aside = next((s for s in self.strategies if s.sets_aside), None)

    @property
    def sets_aside(self) -> bool:
        return self._aside is not None

    def failed(self, taken: Batch, cause: BaseException) -> Verdict:
        failed = Failed(taken, cause)
        for strategy in self.strategies:
            verdict = strategy.failed(failed)
            if verdict is not None:
                return verdict
        raise AssertionError(f"no failure strategy decided on a failed batch: {self.strategies}")

    def undecodable(self, taken: Batch, decoded: Decoded) -> tuple[Batch, Decoded]:
        for strategy in self.strategies:
            taken, decoded = strategy.undecodable(taken, decoded)
        return taken, decoded

    def set_aside(self, conn: Connection, decoded: Decoded, rejects: list[tuple[int, Exception]],
                  letters: list[tuple[Record, Failure]], outgoing: Outgoing | None) -> list[Message]:
        assert self._aside is not None, "messages set aside without a strategy that sets them aside"
        return self._aside.set_aside(conn, decoded, rejects, letters, outgoing)

    def set_aside_landed(self, letters: Sequence[tuple[Record, Failure]]) -> None:
        if self._aside is not None:
            self._aside.set_aside_landed(letters)

    def committed(self, records: Sequence[Record], letters: Sequence[tuple[Record, Failure]]) -> str | None:
        paused = None
        for strategy in self.strategies:
            paused = strategy.committed(records, letters) or paused
        return paused


def where(record: Record) -> str:
    """A message, for a log line."""
    return f"{record.topic}[{record.partition}] offset {record.offset}"


def fields(record: Record) -> dict[str, object]:
    """A log record's fields for one message (``--log-format json`` shows them)."""
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset}
