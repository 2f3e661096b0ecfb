"""Contenders 4 to 7: a kstore :class:`~kstore.Worker` running a benchmark processor.

The worker runs through kstore's public Python API with its default settings
(``KSTORE_*`` variables apply, so a setting can be tried without editing code;
the run records the settings it used). The processor stops the worker once it
has handled every expected message; the worker then commits that last batch
and calls ``teardown()``, which stops the clock.

Latency: a message is done when the transaction holding it has committed. The
processor cannot see that from inside ``handle_batch`` (the commit comes after
it returns), so it listens to the worker's engine: SQLAlchemy's ``commit``
event marks the batch's transaction as committing, and the pool's ``checkin``
event, fired when the worker hands the connection back after COMMIT returned,
stamps the batch. Both only count for the DBAPI connection under the batch's
session, so other connections of the worker (claims, checks, other threads)
cannot stamp it. A rolled-back batch is not stamped; it is handled again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from kstore import Message, Processor, Settings, Worker

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
        self._pending: list[bytes] = []
        self._batch_conn: Any = None  # the DBAPI connection of the batch in flight
        self._committing = False

    def setup(self) -> None:
        if self.meter.latency:
            event.listen(self.engine, "commit", self._on_commit)
            event.listen(self.engine, "rollback", self._on_rollback)
            event.listen(self.engine, "checkin", self._on_checkin)

    def on_assigned(self, partitions: list[tuple[str, int]]) -> None:
        self._assigned.update(partitions)
        if len(self._assigned) >= self.partitions:
            signal_ready(self.ready_file)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.meter.started()
        self.work(msgs)
        if self.meter.latency:
            self._pending = [m.value for m in msgs]
            self._batch_conn = self.session.connection().connection.dbapi_connection
        if self.meter.counted(len(msgs)):
            self.stop()  # the worker still commits this batch, then calls teardown()

    def work(self, msgs: Sequence[Message]) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        if self.meter.count >= self.meter.expected:
            self.meter.finished()

    def _ours(self, conn: Any) -> bool:
        return conn.connection.dbapi_connection is self._batch_conn

    def _on_commit(self, conn: Any) -> None:
        if self._ours(conn):
            self._committing = bool(self._pending)

    def _on_rollback(self, conn: Any) -> None:
        if self._ours(conn):
            self._pending, self._committing = [], False

    def _on_checkin(self, dbapi_conn: Any, _record: Any) -> None:
        if self._committing and dbapi_conn is self._batch_conn:
            self.meter.stamp(self._pending)
            self._pending, self._committing, self._batch_conn = [], False, None

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


class BatchProcessor(_BenchProcessor):
    """The same INSERT for the whole batch: one ``session.execute(insert, rows)``."""

    def work(self, msgs: Sequence[Message]) -> None:
        self.session.execute(self.insert, [self.row(m) for m in msgs])


def _run(processor: _BenchProcessor, config: dict[str, Any]) -> None:
    settings = Settings.from_env(
        dsn=config["dsn"],
        bootstrap_servers=config["bootstrap"],
        group=config["group"],
        topics=(config["topic"],),
        client_id=f"bench-{config['contender']}",
        **config.get("kstore_settings", {}),
    )
    per_run = ("dsn", "bootstrap_servers", "group", "topics")
    processor.meter.extra["kstore_settings"] = {
        k: v for k, v in dataclasses.asdict(settings).items() if k not in per_run
    }
    worker = Worker(processor, settings)
    processor.stop = worker.request_stop
    worker.run()


def noop(config: dict[str, Any], meter: Meter) -> None:
    _run(NoopProcessor(config, meter), config)


def handle(config: dict[str, Any], meter: Meter) -> None:
    _run(HandleProcessor(config, meter), config)


def batch(config: dict[str, Any], meter: Meter) -> None:
    _run(BatchProcessor(config, meter), config)


def handle_immediate(config: dict[str, Any], meter: Meter) -> None:
    _run(ImmediateHandleProcessor(config, meter), config)
