"""The application outbox benchmark: ``python -m benchmarks.app_outbox --help`` (docs/benchmarks.md,
"The application outbox benchmark").

Web-style request transactions, each INSERTing an order row and producing one record keyed by the
customer: :class:`kstore.outbox.Outbox` (published by a ``kstore relay --outbox`` subprocess)
against the same transactions publishing after COMMIT by hand with a plain confluent-kafka
producer (at most once). Each contender runs as 50 threads ("requests") sharing one SQLAlchemy
engine in a process of its own; a ``read_committed`` reader in another process times when each
record became readable. Nothing here is imported by kstore.
"""
