"""Contender 1: a kstore worker whose processor calls ``self.produce()``, its relay in the worker.

Per batch (``handle_batch``): one effect row per message through ``self.session`` (one
multi-row INSERT, as ``benchmarks.kstore_loop``'s bulk contender) and one keyed record per
message with ``self.produce()``, all in the batch's transaction. kstore's default settings
(``KSTORE_*`` variables apply); the relay is the worker's own thread, woken at each commit.

The worker is stopped once the last message committed *and* the outbox is empty (every
record published and marked): stopping sooner would leave records for a later relay.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from kstore import Message, Processor, Settings, Worker
from kstore.relay.store import Outbox
from kstore.settings import SECRETS

from ..kstore_loop import effects_table
from ..meter import Meter, signal_ready
from .records import Stamps, output_record


class ProducingProcessor(Processor):
    def __init__(self, config: dict[str, Any], meter: Meter, stamps: Stamps) -> None:
        self.meter = meter
        self.stamps = stamps
        self.out = config["out_topic"]
        self.partitions = int(config["partitions"])
        self.ready_file: str | None = config.get("ready_file")
        self.insert = effects_table(config["table"]).insert()
        self.all_committed = threading.Event()
        self._assigned: set[tuple[str, int]] = set()

    def on_assigned(self, partitions: list[tuple[str, int]]) -> None:
        self._assigned.update(partitions)
        if len(self._assigned) >= self.partitions:
            signal_ready(self.ready_file)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.meter.started()
        self.stamps.started()
        rows = []
        for m in msgs:
            key, value = output_record(m.partition, m.offset, m.value)
            rows.append({"partition_id": m.partition, "kafka_offset": m.offset, "payload": m.value})
            self.produce(self.out, value, key=key)
        self.session.execute(self.insert, rows)

    def on_committed(self, msgs: Sequence[Message]) -> None:
        self.stamps.add((m.partition, m.offset) for m in msgs)
        if self.meter.counted(len(msgs)):
            self.meter.finished()
            self.all_committed.set()


def _stop_when_published(worker: Worker, processor: ProducingProcessor, outbox: Outbox) -> None:
    """Once every message committed, wait for the relay to empty the outbox, then stop the worker."""
    processor.all_committed.wait()
    while outbox.backlog()[0] > 0:
        time.sleep(0.02)
    worker.request_stop()


def run(config: dict[str, Any], meter: Meter) -> None:
    settings = Settings.from_env(
        dsn=config["dsn"], bootstrap_servers=config["bootstrap"], group=config["group"],
        topics=(config["topic"],), client_id=f"bench-{config['contender']}",
    )
    per_run = ("dsn", "bootstrap_servers", "group", "topics", *SECRETS)
    meter.extra["kstore_settings"] = {k: v for k, v in dataclasses.asdict(settings).items() if k not in per_run}
    stamps = Stamps()
    processor = ProducingProcessor(config, meter, stamps)
    worker = Worker(processor, settings)
    engine = sa.create_engine(config["dsn"])
    outbox = Outbox(engine, config["group"], settings.table_prefix, settings.schema)
    threading.Thread(target=_stop_when_published, args=(worker, processor, outbox), daemon=True).start()
    try:
        worker.run()
    finally:
        engine.dispose()
    stamps.save(config["stamps_file"])
