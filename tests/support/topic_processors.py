"""Processors that declare the topics they produce to (``produces``), run in worker subprocesses by
tests/integration/outbox/test_output_topics.py. The output topic is ``KSTORE_TEST_OUT_TOPIC``, read when the module
is imported (a class attribute), as a user's constant would be."""

from __future__ import annotations

import contextlib
import os

import sqlalchemy as sa

from kstore import Message, Processor

#: The tests' effects table (tests/support/processors.py): one row per message handled.
INSERT_TEXT = sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                      "VALUES (:topic, :partition_id, :kafka_offset, :value, :worker)")

OUT = os.environ.get("KSTORE_TEST_OUT_TOPIC", "order-reserved")


class Announcer(Processor):
    """Records each message (an effect row) and produces its value to ``OUT``, keyed by itself.
    ``"stray"`` is produced to a topic it did not declare instead."""

    group = "announcer"
    value_format = "str"
    on_error = "dead_letter"
    produces = [OUT]

    def handle(self, msg: Message) -> None:
        self.session.execute(INSERT_TEXT, {"topic": msg.topic, "partition_id": msg.partition,
                                           "kafka_offset": msg.offset, "value": msg.value, "worker": "announcer"})
        topic = "never-declared" if msg.value == "stray" else OUT
        self.produce(topic, msg.value, key=msg.value)


class CatchingAnnouncer(Announcer):
    """Catches whatever ``produce()`` raises and goes on, as a careless processor might: an undeclared
    or missing topic must still fail the batch (nothing of it commits)."""

    def handle(self, msg: Message) -> None:
        with contextlib.suppress(Exception):
            super().handle(msg)
