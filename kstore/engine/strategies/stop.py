"""Stop (``on_error="stop"``): a message whose attempts are exhausted stops the worker with a
:class:`~kstore.errors.ProcessorError`, its offset not committed, so the pipeline never moves past a
message it did not handle.

A message that cannot be deserialized stops it too, once it is first in its partition: the batch is
cut before it (the rest goes back to the queues), so what precedes it commits and the stored offset
ends up just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kstore.errors import ProcessorError
from kstore.types import Record
from kstore.types import TopicPartition as TP

from ..decoding import Batch, Decoded, before
from .base import Failed, Strategy, Verdict, where


class Stop(Strategy):
    """Stops the worker on a message that failed every attempt, or cannot be deserialized."""

    def __init__(self, processor_name: str, requeue: Callable[[Sequence[Record], dict[TP, int]], None]) -> None:
        self.processor_name = processor_name
        #: Puts records back in front of their queues (under the generations they were taken in).
        self._requeue = requeue

    def failed(self, failed: Failed) -> Verdict | None:
        failure = failed.failure
        assert failure is not None, "stop decides on a message whose attempts were counted"
        raise ProcessorError(
            f"processor {self.processor_name} failed on {where(failed.taken.records[0])} after {failure.attempts} "
            f"attempt(s): {failure.logged}; its offset was not committed (on_error=stop)"
        ) from failed.cause

    def undecodable(self, taken: Batch, decoded: Decoded) -> tuple[Batch, Decoded]:
        """The batch cut before each partition's first message that cannot be deserialized; once such a
        message is first in its partition, the worker stops."""
        cut: dict[TP, tuple[Record, Exception]] = {}
        for record, error in decoded.undecodable:
            cut.setdefault((record.topic, record.partition), (record, error))
        kept = {tp: [r for r in decoded.records if (r.topic, r.partition) == tp and r.offset < record.offset]
                for tp, (record, _) in cut.items()}
        blocked = next((tp for tp, records in kept.items() if not records), None)
        if blocked is not None:
            self._requeue(taken.records, taken.generations)
            record, error = cut[blocked]
            raise ProcessorError(
                f"processor {self.processor_name} cannot deserialize {record.topic}[{record.partition}] "
                f"offset {record.offset}: {error}; its offset was not committed (on_error=stop)") from error.__cause__
        ends = {tp: record.offset for tp, (record, _) in cut.items()}
        self._requeue([r for r in taken.records if not before(r, ends)], taken.generations)
        records = [r for r in decoded.records if before(r, ends)]
        positions = {tp: pos._replace(next=ends.get(tp, pos.next)) for tp, pos in taken.positions.items()}
        return (Batch(records, taken.generations, positions),
                Decoded([m for m in decoded.msgs if before(m, ends)], records, []))
