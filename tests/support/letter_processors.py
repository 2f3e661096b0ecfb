"""A processor whose dead letters also go to a dead-letter topic (``KSTORE_TEST_DLT_TOPIC``): JSON values
``{"n": N, "kind": ...}``, one effect row per good message (``effects``); ``"reject"`` is rejected at
once, ``"crash"`` fails every attempt, and bytes that are not JSON cannot be deserialized."""

from __future__ import annotations

import os
from collections.abc import Sequence

import sqlalchemy as sa
from processors import effects, metadata

from kstore import Message, Processor, Reject, RetryPolicy


class Lettered(Processor):
    group = "lettered"
    value_format = "json"
    on_error = "dead_letter"
    # Two attempts each, a short wait between: the test writes 1,000 letters, a third of them crashes.
    retry = RetryPolicy(max_attempts=2, backoff_s=0.005, max_backoff_s=0.01)
    dead_letter_topic = os.environ.get("KSTORE_TEST_DLT_TOPIC")

    def setup(self) -> None:
        metadata.create_all(self.engine)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        rows = []
        for msg in msgs:
            kind = msg.value.get("kind")
            if kind == "reject":
                raise Reject(f"order {msg.value['n']} is not for us")
            if kind == "crash":
                raise RuntimeError(f"the handler broke on order {msg.value['n']}")
            rows.append({"topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset,
                         "value": str(msg.value["n"]), "worker": "w"})
        self.session.execute(sa.insert(effects), rows)
