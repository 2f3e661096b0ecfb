"""What a processor's failure does to a batch: the strategies ``on_error`` chooses, one per file, behind
one small interface (:class:`~kstore.engine.strategies.base.Strategy`).

:mod:`kstore.engine.batches` runs a batch; when the processor fails on it, it asks the :class:`Chain`
built here, whose strategies answer in order until one decides: :mod:`.isolate` narrows a batch of
several messages down to the failing one, :mod:`.retry` retries that message in place after a backoff
while its policy allows, then :mod:`.deadletter` (``on_error="dead_letter"``) commits a dead letter in
its place, or :mod:`.stop` (``on_error="stop"``) stops the worker. An answer is :data:`AGAIN` (the
batch goes back to its queues) or :class:`Instead` (a transaction committed in the batch's place,
committed or read back like a batch's); a strategy that stops the worker raises. Another strategy
is another file here and a place in :func:`chain`, never a branch in the batches.

An outage (the database, a missing output topic, the schema registry) is never a message's failure:
the batches wait it out and no strategy is asked. The strategies keep no transaction of their own;
each runs on the worker's main thread. The bookkeeping of attempts and the breaker is
:mod:`kstore.engine.failures`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics
from kstore.types import Record
from kstore.types import TopicPartition as TP

from ..failures import Failures
from .base import AGAIN, Chain, Failed, Instead, Strategy, Verdict
from .deadletter import DeadLetter, OutboxWriter
from .isolate import Isolate
from .retry import RetryInPlace
from .stop import Stop

__all__ = ["AGAIN", "Chain", "Failed", "Instead", "Strategy", "Verdict", "chain"]


def chain(on_error: str, *, processor_name: str, settings: Settings, group: str, metrics: Metrics,
          failures: Failures, outbox: OutboxWriter | None, dead_letter_topic: str | None,
          requeue: Callable[[Sequence[Record], dict[TP, int]], None]) -> Chain:
    """The strategies ``on_error`` names, in the order they are asked."""
    last: Strategy = (DeadLetter(settings, group, metrics, outbox, dead_letter_topic) if on_error == "dead_letter"
                      else Stop(processor_name, requeue))
    return Chain([Isolate(failures), RetryInPlace(failures, metrics), last])
