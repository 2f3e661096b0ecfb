"""``Processor.produce`` without Kafka: what a record becomes (serialization, headers), what is
refused at once (``ProduceError``), and what a batch's rejected messages leave behind.

Through ``kstore.testing.run_batch`` on SQLite: the same ``run_handler`` the worker calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import (
    KstoreError,
    Message,
    MissingTopicError,
    Processor,
    ProduceError,
    Reject,
    UndeclaredTopicError,
)
from kstore.running.handler import Outgoing, produce_check, run_handler
from kstore.testing import make_message, run_batch
from kstore.types import Produced


class Echo(Processor):
    """Produces each message's value to ``out`` with the message's key."""

    def handle(self, msg: Message) -> None:
        self.produce("out", msg.value, key=msg.key, headers={"src": str(msg.offset)})


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    e = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    yield e
    e.dispose()


def test_values_and_keys_are_serialized_as_kafka_bytes(engine: Any) -> None:
    values: list[Any] = [b"raw", "text \u00e9", {"a": [1, 2]}, 7, None]
    outcome = run_batch(Echo(), [make_message(v, offset=i, key=f"k{i}") for i, v in enumerate(values)], engine)
    assert [r.value for r in outcome.produced] == [b"raw", "text \u00e9".encode(), b'{"a":[1,2]}', b"7", None]
    assert [r.key for r in outcome.produced] == [b"k0", b"k1", b"k2", b"k3", b"k4"]
    assert outcome.produced[2].headers == (("src", b"2"),)
    assert all(r.topic == "out" and r.partition is None for r in outcome.produced)


@pytest.mark.parametrize("value", [{1, 2}, float("nan"), object()])
def test_a_value_that_cannot_be_serialized_is_refused_at_produce(engine: Any, value: Any) -> None:
    with pytest.raises(ProduceError, match="cannot serialize the value"):
        run_batch(Echo(), [make_message(value)], engine)
    assert issubclass(ProduceError, Reject), "refused records are final: dead-lettered at once or stop, by policy"


def test_produce_outside_a_batch_is_a_clear_error() -> None:
    with pytest.raises(KstoreError, match="only works inside handle"):
        Echo().produce("out", b"x")


def test_the_check_refuses_oversized_records_and_partitions_and_waits_for_unknown_topics() -> None:
    counts = {"out": 3}.get
    check = produce_check(lambda t: counts(t, 0), max_bytes=100, where="Kafka at here")
    check(Produced("out", b"x" * 90, b"k", (("h", b"12345"),), 2))
    with pytest.raises(ProduceError, match="over outbox_max_record_bytes=100"):
        check(Produced("out", b"x" * 95, b"k", (("h", b"12345"),)))
    # A topic the cluster lacks is an outage (the batch waits for it), never the message's failure.
    with pytest.raises(MissingTopicError, match="output topic 'nope' does not exist in Kafka at here"):
        check(Produced("nope", b"x"))
    assert not issubclass(MissingTopicError, Reject)
    declared = produce_check(lambda t: counts(t, 0), max_bytes=100, produces=frozenset({"out"}))
    with pytest.raises(UndeclaredTopicError, match="'nope', which is not in produces \\(out\\)"):
        declared(Produced("nope", b"x"))
    with pytest.raises(ProduceError, match="has 3 partition"):
        check(Produced("out", b"x", partition=3))
    # Brokers that do not answer: the record goes on (the relay will not skip it), never refused for that.
    produce_check(lambda _t: None, max_bytes=100)(Produced("nope", b"x"))


class RejectsOdd(Processor):
    """Produces for every message, then rejects the odd offsets: their records must not be kept."""

    def handle(self, msg: Message) -> None:
        self.produce("out", f"v{msg.offset}")
        if msg.offset % 2:
            raise Reject("odd")


def test_a_rejected_message_produces_nothing(engine: Any) -> None:
    msgs = [make_message(b"x", offset=i) for i in range(6)]
    outgoing = Outgoing()
    rejects: list[tuple[int, Exception]] = []
    processor = RejectsOdd()
    processor.engine = engine
    with engine.connect() as conn, conn.begin():
        run_handler(processor, conn, msgs, rejects=rejects, outgoing=outgoing)
    assert [i for i, _ in rejects] == [1, 3, 5]
    assert [r.value for r in outgoing.records] == [b"v0", b"v2", b"v4"]


class BatchProducer(Processor):
    def handle_batch(self, msgs: Sequence[Message]) -> None:
        for m in msgs:
            self.produce("out", {"n": m.offset}, key=m.key, partition=m.offset % 2)


def test_handle_batch_produces_in_order(engine: Any) -> None:
    outcome = run_batch(BatchProducer(), [make_message(b"", offset=i, key=b"k") for i in range(4)], engine)
    assert [json.loads(r.value or b"") for r in outcome.produced] == [{"n": i} for i in range(4)]
    assert [r.partition for r in outcome.produced] == [0, 1, 0, 1]
