"""Contenders 4 to 7: a kstore :class:`~kstore.Worker` running a benchmark processor.

The worker runs through kstore's public Python API with its default settings
(``KSTORE_*`` variables apply, so a setting can be tried without editing code;
the run records the settings it used). The processor counts messages as their
batches commit; when the last one has, it stops the clock and the worker (whose
shutdown, leaving the group, is not timed).

Latency: a message is done when the transaction holding it has committed, which
the processor hears in ``on_committed(msgs)``, called by the worker after COMMIT
returned (a rolled-back batch is not reported; it is handled again).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from kstore import Message, Processor, Settings, Worker
from kstore.settings import SECRETS
from kstore.telemetry.metrics import Metrics

from .meter import Meter, signal_ready


def effects_table(name: str) -> sa.Table:
    """The effects table as the parent created it (see effects.create_table)."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("partition_id", sa.Integer, nullable=False),
        sa.Column("kafka_offset", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.LargeBinary),
    )


class _BenchProcessor(Processor):
    """Counts, stops the worker at the end, and stamps latencies; subclasses do the work."""

    def __init__(self, config: dict[str, Any], meter: Meter) -> None:
        self.meter = meter
        self.partitions = int(config["partitions"])
        self.ready_file: str | None = config.get("ready_file")
        self.insert = effects_table(config["table"]).insert() if config.get("table") else None
        self.stop: Callable[[], None] = lambda: None
        self._assigned: set[tuple[str, int]] = set()

    def on_assigned(self, partitions: list[tuple[str, int]]) -> None:
        self._assigned.update(partitions)
        if len(self._assigned) >= self.partitions:
            signal_ready(self.ready_file)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.meter.started()
        self.work(msgs)

    def work(self, msgs: Sequence[Message]) -> None:
        raise NotImplementedError

    def on_committed(self, msgs: Sequence[Message]) -> None:
        if self.meter.latency:
            self.stamp(msgs)
        if self.meter.counted(len(msgs)):
            self.meter.finished()  # the last message is committed: stop the clock here, not after shutdown
            self.stop()

    def stamp(self, msgs: Sequence[Message]) -> None:
        """The messages are done now: their produce times are their values' leading digits."""
        self.meter.stamp(m.value for m in msgs)

    def row(self, msg: Message) -> dict[str, Any]:
        return {"partition_id": msg.partition, "kafka_offset": msg.offset, "payload": msg.value}


class NoopProcessor(_BenchProcessor):
    def work(self, msgs: Sequence[Message]) -> None:
        pass


class HandleProcessor(_BenchProcessor):
    """One INSERT per message in ``handle()``, called by kstore's default ``handle_batch``."""

    def work(self, msgs: Sequence[Message]) -> None:
        Processor.handle_batch(self, msgs)

    def handle(self, msg: Message) -> None:
        self.session.execute(self.insert, self.row(msg))


class ImmediateHandleProcessor(HandleProcessor):
    """Contender 5 with each INSERT sent at once (kstore's deferred INSERTs turned off)."""

    defer_inserts = False


class TextHandleProcessor(HandleProcessor):
    """One ``session.execute(text("INSERT ..."), row)`` per message, as most users write it."""

    def __init__(self, config: dict[str, Any], meter: Meter) -> None:
        super().__init__(config, meter)
        self.sql = sa.text(f"INSERT INTO {config['table']} (partition_id, kafka_offset, payload) "
                           "VALUES (:partition_id, :kafka_offset, :payload)")

    def handle(self, msg: Message) -> None:
        self.session.execute(self.sql, self.row(msg))


class CopyProcessor(_BenchProcessor):
    """The whole batch with ``session.copy_rows(table, rows)``: PostgreSQL's COPY, in the batch's transaction."""

    def __init__(self, config: dict[str, Any], meter: Meter) -> None:
        super().__init__(config, meter)
        self.table = effects_table(config["table"])

    def work(self, msgs: Sequence[Message]) -> None:
        self.session.copy_rows(self.table, [(m.partition, m.offset, m.value) for m in msgs])


class BatchProcessor(_BenchProcessor):
    """The same INSERT for the whole batch: one ``session.execute(insert, rows)``."""

    def work(self, msgs: Sequence[Message]) -> None:
        self.session.execute(self.insert, [self.row(m) for m in msgs])


def avro_effects_table(name: str) -> sa.Table:
    """The Avro workload's effects table as the parent created it (see benchmarks.avro)."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("partition_id", sa.Integer, nullable=False),
        sa.Column("kafka_offset", sa.BigInteger, nullable=False),
        sa.Column("id", sa.BigInteger, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("price", sa.Float, nullable=False),
        sa.Column("quantity", sa.Integer, nullable=False),
    )


class AvroBatchProcessor(_BenchProcessor):
    """Contender 6's bulk INSERT of Avro values decoded by kstore (``value_format = "avro"``): the
    record's fields are the row (``benchmarks.avro``)."""

    value_format = "avro"

    def __init__(self, config: dict[str, Any], meter: Meter) -> None:
        super().__init__(config, meter)
        self.insert = avro_effects_table(config["table"]).insert()

    def work(self, msgs: Sequence[Message]) -> None:
        self.session.execute(self.insert, [self.row(m) for m in msgs])

    def row(self, msg: Message) -> dict[str, Any]:
        return {"partition_id": msg.partition, "kafka_offset": msg.offset, **msg.value}

    def stamp(self, msgs: Sequence[Message]) -> None:
        self.meter.stamp_ns(m.value["id"] for m in msgs)  # ``id``: the produce time


def _run(processor: _BenchProcessor, config: dict[str, Any]) -> None:
    settings = Settings.from_env(
        dsn=config["dsn"],
        bootstrap_servers=config["bootstrap"],
        group=config["group"],
        topics=(config["topic"],),
        client_id=f"bench-{config['contender']}",
        **config.get("kstore_settings", {}),
    )
    per_run = ("dsn", "bootstrap_servers", "group", "topics", "schema_registry_url", *SECRETS)
    processor.meter.extra["kstore_settings"] = {
        k: v for k, v in dataclasses.asdict(settings).items() if k not in per_run
    }
    worker = Worker(processor, settings)
    processor.stop = worker.request_stop
    if config.get("unrecorded"):
        worker.metrics = _Unrecorded(worker.group)
    if settings.metrics_port is not None:
        threading.Thread(target=_scrape, args=(worker, processor.meter), daemon=True).start()
    worker.run()
    if not config.get("unrecorded"):
        processor.meter.extra["main_thread"] = main_thread(worker)


def main_thread(worker: Worker) -> dict[str, float]:
    """Where the worker's main thread spent the drain, from its own metrics: inside batches (from
    taking one to its COMMIT's answer), and of that in the offsets' write and COMMIT. The rest of
    the drain it waited for records (or did a claim, an epoch check)."""
    def total(name: str) -> float:
        return worker.metrics.registry.get_sample_value(name, {"group": worker.group}) or 0.0

    return {"batches": int(total("kstore_batches_committed_total")),
            "in_batches_s": round(total("kstore_batch_duration_seconds_sum"), 3),
            "committing_s": round(total("kstore_commit_duration_seconds_sum"), 3)}


class _Unrecorded(Metrics):
    """Metrics that record nothing: the baseline the cost of recording is measured against."""


for _name in ("committed", "rolled_back", "claimed", "rebalanced", "fenced", "retried", "dead_lettered",
              "database_error", "in_doubt_resolved"):
    setattr(_Unrecorded, _name, lambda self, *args, **kwargs: None)


def _scrape(worker: Worker, meter: Meter) -> None:
    """GET /metrics every second, as a (busy) Prometheus would; counts the scrapes."""
    while worker.metrics_port is None:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    scrapes = 0
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
        scrapes += 1
        meter.extra["metrics_scrapes"] = scrapes
        time.sleep(1.0)


def noop(config: dict[str, Any], meter: Meter) -> None:
    _run(NoopProcessor(config, meter), config)


def handle(config: dict[str, Any], meter: Meter) -> None:
    _run(HandleProcessor(config, meter), config)


def batch(config: dict[str, Any], meter: Meter) -> None:
    _run(BatchProcessor(config, meter), config)


def handle_immediate(config: dict[str, Any], meter: Meter) -> None:
    _run(ImmediateHandleProcessor(config, meter), config)


def handle_text(config: dict[str, Any], meter: Meter) -> None:
    _run(TextHandleProcessor(config, meter), config)


def copy(config: dict[str, Any], meter: Meter) -> None:
    _run(CopyProcessor(config, meter), config)


def batch_scraped(config: dict[str, Any], meter: Meter) -> None:
    _run(BatchProcessor(config, meter), config)


def batch_avro(config: dict[str, Any], meter: Meter) -> None:
    _run(AvroBatchProcessor(config, meter), config)


def batch_unrecorded(config: dict[str, Any], meter: Meter) -> None:
    _run(BatchProcessor(config, meter), {**config, "unrecorded": True})
