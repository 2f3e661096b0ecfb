"""kstore.testing runs a processor that reads and writes Avro without a registry server: its
InMemoryRegistry encodes the test's records and decodes what the processor produced."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa

from kstore import DeserializationError, Message, Processor
from kstore.schemas import Avro
from kstore.testing import InMemoryRegistry, make_message, run_batch
from tests.support.schema_data import ORDER_EVENT, ORDER_V1, ORDER_V2, OrderRecord

metadata = sa.MetaData()
accepted = sa.Table("accepted", metadata, sa.Column("id", sa.BigInteger, primary_key=True),
                    sa.Column("currency", sa.String(10)))


class Acceptor(Processor):
    topics = ["orders"]
    group = "acceptor"
    value_format = "avro"
    value_schema = ORDER_V2
    value_model = OrderRecord
    on_error = "dead_letter"
    output_schemas = {"accepted": Avro(ORDER_EVENT)}

    def setup(self) -> None:
        metadata.create_all(self.engine)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        for msg in msgs:
            self.session.execute(accepted.insert(), {"id": msg.value.id, "currency": msg.value.currency})
            self.produce("accepted", {"order_id": msg.value.id, "total_cents": round(msg.value.amount * 100)})


def test_a_schemad_processor_runs_on_the_in_memory_registry(tmp_path: Path) -> None:
    registry = InMemoryRegistry()
    good = registry.encode("orders", {"id": 1, "customer": "c1", "amount": 9.5}, Avro(ORDER_V1))
    bad = good[:6]
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    outcome = run_batch(Acceptor(), [make_message(good, topic="orders", raw=True),
                                     make_message(bad, topic="orders", offset=1, raw=True)], engine, registry=registry)
    assert [registry.decode(r.value) for r in outcome.produced] == [{"order_id": 1, "total_cents": 950}]
    assert [(r.message.offset, type(r.error)) for r in outcome.rejected] == [(1, DeserializationError)]
    with engine.connect() as conn:
        assert conn.execute(sa.select(accepted.c.id, accepted.c.currency)).all() == [(1, "EUR")]
