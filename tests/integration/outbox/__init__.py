"""Kafka -> database -> Kafka: produce(), the outbox, its relay, declared output topics."""
