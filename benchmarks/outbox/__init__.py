"""The outbox benchmark: ``python -m benchmarks.outbox --help`` (docs/benchmarks.md, "The outbox benchmark").

Kafka -> PostgreSQL -> Kafka: every contender reads the same JSON messages, writes one effect
row per message and produces one keyed record per message to an output topic, which a
``read_committed`` reader in a process of its own times. kstore's ``Processor.produce`` (the
outbox and the relay in the worker) against two loops written by hand. It reuses the side-by-side
benchmark's child process, services and effects checks; nothing here is imported by kstore.
"""
