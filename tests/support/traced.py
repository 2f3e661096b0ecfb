"""A processor whose process sets up OpenTelemetry's SDK at import, as a user's would, and
writes every finished span as a JSON line to ``$KSTORE_TEST_SPANS`` (``traced:TracedRecorder``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from processors import effects

from kstore import Message, Processor


class JsonLinesExporter(SpanExporter):  # type: ignore[misc]
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as out:
            for span in spans:
                out.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["KSTORE_TEST_SPANS"])))
trace.set_tracer_provider(provider)


class TracedRecorder(Processor):
    """One INSERT per message in handle() (so each message gets its own span)."""

    group = "traced"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        self.session.execute(effects.insert(), {"topic": msg.topic, "partition_id": msg.partition,
                                                "kafka_offset": msg.offset, "value": msg.value, "worker": "traced"})


class TracedBatchRecorder(TracedRecorder):
    """Overrides handle_batch: one span per batch, none per message."""

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        for msg in msgs:
            self.handle(msg)
