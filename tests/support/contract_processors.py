"""Processors that test the batch's transaction from the processor's side: slow ones, ones that
end the transaction themselves, and coroutines behind plain decorators (``contract_processors:X``)."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from kstore import Message, Processor

#: The tests' effects table (tests/support/processors.py); this module is loaded by worker subprocesses by its
#: own name, so it imports nothing of the tests package.
INSERT_TEXT = sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                      "VALUES (:topic, :partition_id, :kafka_offset, :value, :worker)")
UPSERT_TEXT = sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                      "VALUES (:topic, :partition_id, :kafka_offset, :value, :worker) ON CONFLICT DO NOTHING")
_STALL = os.environ.get("KSTORE_TEST_STALL_VALUE")


def _row(msg: Message, worker: str) -> dict[str, Any]:
    return {"topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset, "value": msg.value,
            "worker": worker}


class Slow(Processor):
    """handle() per message: ``KSTORE_TEST_SLEEP_MS`` of Python, then one deferred text() INSERT.

    The message whose value is ``KSTORE_TEST_STALL_VALUE`` stalls: with
    ``KSTORE_TEST_STALL=idle`` it runs a query and then sleeps ``KSTORE_TEST_STALL_S`` inside the
    transaction (past the server's idle-in-transaction timeout); with ``KSTORE_TEST_STALL=statement``
    it runs ``pg_sleep(KSTORE_TEST_STALL_S)`` (past kstore's deadline per round trip)."""

    group = "slow"
    value_format = "str"

    def setup(self) -> None:
        self.sleep_s = float(os.environ.get("KSTORE_TEST_SLEEP_MS", "0")) / 1000
        self.stall = os.environ.get("KSTORE_TEST_STALL", "idle")
        self.stall_s = float(os.environ.get("KSTORE_TEST_STALL_S", "0"))

    def handle(self, msg: Message) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if msg.value == _STALL:
            if self.stall == "idle":
                self.session.execute(sa.text("SELECT 1"))
                time.sleep(self.stall_s)
            else:
                self.session.execute(sa.text("SELECT pg_sleep(:s)"), {"s": self.stall_s})
        self.session.execute(INSERT_TEXT, _row(msg, "slow"))


def plain_decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An ordinary sync decorator (logging, metrics...): it hides that ``fn`` is a coroutine function."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class WrappedCoroutine(Processor):
    """``async def handle`` behind a plain decorator: passes the start-up check, returns coroutines."""

    group = "wrapped-coroutine"
    value_format = "str"

    @plain_decorator
    async def handle(self, msg: Message) -> None:  # type: ignore[override]
        self.session.execute(INSERT_TEXT, _row(msg, "coro"))


class WrappedCoroutineHook(Processor):
    """A plain handle(), and an ``async def on_committed`` behind a plain decorator."""

    group = "wrapped-coroutine-hook"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        self.session.execute(INSERT_TEXT, _row(msg, "hook"))

    @plain_decorator
    async def on_committed(self, msgs: Any) -> None:  # type: ignore[override]
        pass


class EndsTransaction(Processor):
    """handle() per message, writing a row; then, by the message's value: "dbapi-commit" or
    "dbapi-rollback" calls commit()/rollback() on the DBAPI connection under the session (caught,
    as a careless library would); "sql-commit" sends COMMIT through SQL."""

    group = "ends-transaction"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        self.session.execute(INSERT_TEXT, _row(msg, "ends"))
        if msg.value.startswith("dbapi-"):
            raw = self.session.connection().connection
            # A library that swallows errors: the batch must fail all the same.
            with contextlib.suppress(Exception):
                raw.commit() if msg.value.startswith("dbapi-commit") else raw.rollback()
        elif msg.value.startswith("sql-commit"):
            self.session.execute(sa.text("COMMIT"))


class UpsertsFirst(Processor):
    """handle_batch() whose first round trip is an executemany of an upsert (as the demo's page-view
    counter does): one row per message, ``ON CONFLICT DO NOTHING``. A batch holding "sql-commit" then
    sends COMMIT through SQL."""

    group = "upserts-first"
    value_format = "str"

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.session.execute(UPSERT_TEXT, [_row(m, "upserts") for m in msgs])
        if any(m.value == "sql-commit" for m in msgs):
            self.session.execute(sa.text("COMMIT"))


class ReadsOnly(Processor):
    """Writes nothing: every other message only reads (a batch's transaction with no write, or no
    round trip at all)."""

    group = "reads-only"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        if msg.offset % 2:
            self.session.execute(sa.text("SELECT 1"))
