"""What a running worker tells the outside: Prometheus metrics, health probes, traces.

- :mod:`~kstore.telemetry.metrics`: :class:`~kstore.telemetry.metrics.Metrics`, one per worker,
  on its own registry (several workers in one process never mix), and the lag metric families
  the exporter serves under the same names.
- :mod:`~kstore.telemetry.health`: the worker's HTTP port (``--metrics-port``): ``/metrics``,
  ``/livez``, ``/readyz``, served by daemon threads that only read the worker's state.
- :mod:`~kstore.telemetry.tracing`: OpenTelemetry spans per batch and per message, optional;
  without a configured tracer provider nothing is made.

The engine writes to these; nothing here drives the engine. May import the shared vocabulary
(a span reads a :class:`~kstore.Message`); never the engine, :mod:`kstore.running` (which names a
tracer by a protocol of its own), the database side, the Kafka side or the operator's tools.
"""
