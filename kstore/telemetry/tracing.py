"""OpenTelemetry tracing, optional (``pip install kstore[otel]``).

With the OpenTelemetry API installed and a tracer provider configured (the SDK's, set
before the worker starts), each batch is one CONSUMER span (``process <topic>``) and,
when the processor uses ``handle()``, each message is a span of its own inside it,
following the messaging semantic conventions (``messaging.system=kafka``,
``messaging.destination.name``, ``messaging.destination.partition.id``,
``messaging.consumer.group.name``, ``messaging.kafka.offset``). A message carrying a
W3C ``traceparent`` header links its span (and the batch's) to the producer's.

Without OpenTelemetry, or with no provider configured, nothing is imported beyond a
failed ``import`` and no span is made: a message costs nothing extra.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from kstore.types import Message

#: At most this many producer links on a batch's span (a batch can hold thousands of messages).
MAX_BATCH_LINKS = 128

try:
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter
except ImportError:  # the otel extra is not installed
    trace = None  # type: ignore[assignment]


def _configured() -> bool:
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


if trace is not None:
    class _HeaderGetter(Getter[Sequence[tuple[str, bytes | None]]]):
        """Reads W3C trace context from Kafka headers (bytes values)."""

        def get(self, carrier: Sequence[tuple[str, bytes | None]], key: str) -> list[str] | None:
            values = [v.decode("latin-1") for k, v in carrier if k.lower() == key and v is not None]
            return values or None

        def keys(self, carrier: Sequence[tuple[str, bytes | None]]) -> list[str]:
            return [k for k, _ in carrier]

    _GETTER = _HeaderGetter()


class Tracing:
    """Spans for one worker's batches and messages; every method is a no-op when disabled."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.enabled = _configured()
        self._tracer: Any = trace.get_tracer("kstore") if self.enabled else None

    def _link(self, msg: Message) -> Any:
        if not msg.headers:
            return None
        context = propagate.extract(msg.headers, getter=_GETTER)
        span_context = trace.get_current_span(context).get_span_context()
        return trace.Link(span_context) if span_context.is_valid else None

    @contextlib.contextmanager
    def batch(self, msgs: Sequence[Message]) -> Iterator[None]:
        """One CONSUMER span around a batch's processing (within its transaction)."""
        if not self.enabled or not msgs:
            yield
            return
        topics = sorted({m.topic for m in msgs})
        partitions = {(m.topic, m.partition) for m in msgs}
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.consumer.group.name": self.group,
            "messaging.batch.message_count": len(msgs),
            "messaging.destination.name": topics[0] if len(topics) == 1 else ",".join(topics),
        }
        if len(partitions) == 1:
            attributes["messaging.destination.partition.id"] = str(msgs[0].partition)
        links = [link for link in (self._link(m) for m in msgs[:MAX_BATCH_LINKS]) if link is not None]
        name = f"process {attributes['messaging.destination.name']}"
        with self._tracer.start_as_current_span(name, kind=trace.SpanKind.CONSUMER, attributes=attributes,
                                                links=links):
            yield

    @contextlib.contextmanager
    def message(self, msg: Message) -> Iterator[None]:
        """One span around ``handle(msg)``, inside the batch's span, linked to the producer's."""
        if not self.enabled:
            yield
            return
        attributes = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.consumer.group.name": self.group,
            "messaging.destination.name": msg.topic,
            "messaging.destination.partition.id": str(msg.partition),
            "messaging.kafka.offset": msg.offset,
        }
        link = self._link(msg)
        with self._tracer.start_as_current_span(f"process {msg.topic}", kind=trace.SpanKind.CONSUMER,
                                                attributes=attributes, links=[link] if link else None):
            yield
