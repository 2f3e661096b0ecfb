"""Processors the integration tests run in worker subprocesses (``processors:Recorder``)."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa

from kstore import Message, Processor, Reject, RetryPolicy

metadata = sa.MetaData()
effects = sa.Table(
    "effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("topic", sa.String(255), nullable=False),
    sa.Column("partition_id", sa.Integer, nullable=False),
    sa.Column("kafka_offset", sa.BigInteger, nullable=False),
    sa.Column("value", sa.Text),
    sa.Column("worker", sa.String(64)),
)

INSERT_TEXT = sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                      "VALUES (:topic, :partition_id, :kafka_offset, :value, :worker)")


class Recorder(Processor):
    """Inserts one row per message; no unique key, so a duplicate effect shows up as two rows.

    Test hooks, from the environment:
    KSTORE_TEST_BATCH_SLEEP: seconds to sleep after writing each batch (before the commit).
    KSTORE_TEST_HANG_AT / KSTORE_TEST_HANG_FILE / KSTORE_TEST_HANG_SECONDS: after writing the
    batch holding that offset, create the file and sleep (so a test can kill or stop the
    process between the processor's writes and the commit).
    KSTORE_TEST_FAIL_AT: raise on the message with that offset.
    KSTORE_TEST_PER_MESSAGE: write one INSERT per message (deferred by kstore's session, sent
    by the flush before the hang) instead of one executemany for the batch.
    KSTORE_TEST_WRITE: how the rows go in: "insert" (the default: a Core INSERT), "text" (a
    ``text("INSERT ...")`` per message, deferred by kstore's session) or "copy" (``session.copy_rows``).
    KSTORE_TEST_DB_POISON: a value whose row breaks a NOT NULL constraint in the database itself
    (its topic is NULL), so the failure comes from the write, not from the processor's code.
    KSTORE_TEST_PAUSE_FILE: while that file exists, a batch waits before writing (and its
    first offset is written to the file + ".batch"), so a test can act while a batch is in flight.
    KSTORE_TEST_START_GATE: setup() waits until that file exists (before the worker joins its
    group), so a test can have several workers join at the same moment.
    """

    group = "recorder"
    value_format = "str"

    def setup(self) -> None:
        self.name = os.environ.get("KSTORE_TEST_WORKER_NAME", str(os.getpid()))
        self.batch_sleep = float(os.environ.get("KSTORE_TEST_BATCH_SLEEP", "0"))
        self.hang_at = int(os.environ.get("KSTORE_TEST_HANG_AT", "-1"))
        self.hang_file = os.environ.get("KSTORE_TEST_HANG_FILE")
        self.hang_seconds = float(os.environ.get("KSTORE_TEST_HANG_SECONDS", "3600"))
        self.fail_at = int(os.environ.get("KSTORE_TEST_FAIL_AT", "-1"))
        self.fail_value = os.environ.get("KSTORE_TEST_FAIL_VALUE")
        self.pause_file = os.environ.get("KSTORE_TEST_PAUSE_FILE")
        self.per_message = os.environ.get("KSTORE_TEST_PER_MESSAGE") == "1"
        self.write = os.environ.get("KSTORE_TEST_WRITE", "insert")
        self.db_poison = os.environ.get("KSTORE_TEST_DB_POISON")
        gate = os.environ.get("KSTORE_TEST_START_GATE")
        while gate and not Path(gate).exists():
            time.sleep(0.01)

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        if self.pause_file and Path(self.pause_file).exists():
            tmp = Path(self.pause_file + ".tmp")
            tmp.write_text(f"{msgs[0].partition}:{msgs[0].offset}")
            tmp.rename(self.pause_file + ".batch")
            while Path(self.pause_file).exists():
                time.sleep(0.02)
        for m in msgs:
            if m.offset == self.fail_at:
                raise ValueError(f"cannot handle offset {m.offset}")
            if self.fail_value is not None and m.value == self.fail_value:
                raise ValueError(f"poison message at {m.topic}[{m.partition}] offset {m.offset}")
        rows = [
            {"topic": None if m.value == self.db_poison else m.topic, "partition_id": m.partition,
             "kafka_offset": m.offset, "value": str(m.value),
             "worker": self.name}
            for m in msgs
        ]
        self._write(rows)
        self.session.flush()
        if self.batch_sleep:
            time.sleep(self.batch_sleep)
        if self.hang_file and any(m.offset == self.hang_at for m in msgs):
            path = Path(self.hang_file)
            if not path.exists():  # hang once, not again after a restart
                # Written whole, then renamed: a test that sees the file can read all of it.
                tmp = path.with_suffix(".tmp")
                tmp.write_text(",".join(f"{m.topic}:{m.partition}:{m.offset}" for m in msgs))
                tmp.rename(path)
                time.sleep(self.hang_seconds)


    def _write(self, rows: list[dict[str, object]]) -> None:
        if self.write == "copy":
            self.session.copy_rows(effects, rows)
        elif self.write == "text":
            for row in rows:
                self.session.execute(INSERT_TEXT, row)
        elif self.per_message:
            for row in rows:
                self.session.execute(effects.insert(), row)
        else:
            self.session.execute(effects.insert(), rows)


class JsonRecorder(Recorder):
    """Recorder for JSON values: a value that is not JSON fails to deserialize."""

    value_format = "json"


def oauth_token() -> str:
    """An OAUTHBEARER token Kafka's default (unsecured) validator accepts: an unsigned JWT
    (alg none) with a subject, issued now, expiring in an hour. Used as
    ``--sasl-oauth-token-provider processors:oauth_token``."""
    def part(obj: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    now = int(time.time())
    return f"{part({'alg': 'none'})}.{part({'sub': 'kstore-test', 'iat': now, 'exp': now + 3600})}."


class Validating(Processor):
    """handle() per message: a value starting with "bad" is rejected before anything is written;
    one starting with "late-bad" is rejected after its row was written (the write must roll back);
    "flaky" raises ValueError, which ``KSTORE_TEST_GIVE_UP_ON_VALUE_ERROR=1`` makes final."""

    group = "validating"
    value_format = "str"
    retry = RetryPolicy(give_up_on=(ValueError,) if os.environ.get("KSTORE_TEST_GIVE_UP_ON_VALUE_ERROR") == "1"
                        else ())

    def handle(self, msg: Message) -> None:
        if msg.value.startswith("bad"):
            raise Reject(f"invalid value {msg.value!r}")
        if msg.value.startswith("flaky"):
            raise ValueError(f"cannot parse {msg.value!r}")
        self.session.execute(effects.insert(), {"topic": msg.topic, "partition_id": msg.partition,
                                                "kafka_offset": msg.offset, "value": msg.value, "worker": "v"})
        if msg.value.startswith("late-bad"):
            raise Reject(f"found invalid after writing: {msg.value!r}")


class AsyncHook(Processor):
    """An ``async def`` hook that kstore does not run on its event loop (only handle, handle_batch,
    setup and teardown may be async)."""

    group = "async"

    def handle(self, msg: Message) -> None:
        pass

    async def on_committed(self, msgs: Sequence[Message]) -> None:  # type: ignore[override]
        pass


class SessionMisuse(Processor):
    """handle() per message; "close" writes through `with self.session as s:` (which closes the
    session), "rollback" calls self.session.rollback() after writing."""

    group = "misuse"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        row = {"topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset, "value": msg.value,
               "worker": "m"}
        if msg.value.startswith("close"):
            with self.session as s:
                s.execute(effects.insert(), row)
            return
        self.session.execute(effects.insert(), row)
        if msg.value.startswith("rollback"):
            self.session.rollback()


NOTED_INSERT = sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                       "VALUES (:topic, :partition_id, :kafka_offset, :value, 'noted') -- note")


class NotedInserts(Processor):
    """One ``text()`` INSERT per message that ends with a ``-- note`` comment: per message (deferred by
    kstore's session) or, with ``KSTORE_TEST_MANY=1``, as one executemany for the batch."""

    group = "noted"
    value_format = "str"

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        rows = [{"topic": m.topic, "partition_id": m.partition, "kafka_offset": m.offset, "value": m.value}
                for m in msgs]
        if os.environ.get("KSTORE_TEST_MANY") == "1":
            self.session.execute(NOTED_INSERT, rows)
        else:
            for row in rows:
                self.session.execute(NOTED_INSERT, row)


class AsyncKeyed(Processor):
    """``async def handle``: awaits a random 0-``KSTORE_TEST_MAX_SLEEP_MS`` ms (a slow call per message),
    then writes its effect through the async session. Values are ``<key>:<n>``; "poison" in a value
    fails the message after it wrote (the batch fails and is narrowed down), "reject" in a value
    raises :class:`Reject` before it touched anything (dead-lettered inside its batch). The effects'
    ids are the order the handlers wrote in: per key, they must follow the offsets."""

    group = "async-keyed"
    value_format = "str"
    key_format = "str"

    def setup(self) -> None:
        import random

        self.rng = random.Random()
        self.max_sleep = float(os.environ.get("KSTORE_TEST_MAX_SLEEP_MS", "5")) / 1000
        self.name = os.environ.get("KSTORE_TEST_WORKER_NAME", str(os.getpid()))

    async def handle(self, msg: Message) -> None:
        import asyncio

        if "reject" in msg.value:
            raise Reject(f"unusable value {msg.value!r}")
        await asyncio.sleep(self.rng.random() * self.max_sleep)
        await self.session.execute(effects.insert(), {"topic": msg.topic, "partition_id": msg.partition,
                                                      "kafka_offset": msg.offset, "value": msg.value,
                                                      "worker": self.name})
        if "poison" in msg.value:
            raise ValueError(f"poison message {msg.value!r}")
        if "hang" in msg.value:  # written; now waits forever (a call that never answers)
            Path(os.environ["KSTORE_TEST_HANG_FILE"]).touch()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                print(f"handler of offset {msg.offset} cancelled", flush=True)
                raise


class FailingSetup(Processor):
    """Its setup() reads a table nobody created: the worker cannot start."""

    group = "failing-setup"

    def setup(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(sa.text("SELECT * FROM no_such_table WHERE id = :id"), {"id": 1})

    def handle(self, msg: Message) -> None:
        raise AssertionError("never reached: setup() failed")
