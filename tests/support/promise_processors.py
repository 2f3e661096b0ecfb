"""Processors for the tests of what the README and docs promise (``promise_processors:X``).

Worker subprocesses load this module by its own name (PYTHONPATH=tests), so it imports nothing of
the tests package: the effects table's INSERT is repeated here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from kstore import Message, Processor

INSERT_TEXT = sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                      "VALUES (:topic, :partition_id, :kafka_offset, :value, :worker)")


def _row(msg: Message, value: Any = None, worker: str = "p") -> dict[str, Any]:
    return {"topic": msg.topic, "partition_id": msg.partition, "kafka_offset": msg.offset,
            "value": msg.value if value is None else value, "worker": worker}


def _note(path: str | None, **entry: Any) -> None:
    """Append one JSON line to ``path`` (a side channel the test reads)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class HookLog(Processor):
    """Writes every hook call, in order, as JSON lines to ``KSTORE_TEST_HOOK_LOG``, and one effect
    row per message. Each line: the hook, its partitions (or the message's), the worker's name."""

    group = "hook-log"
    value_format = "str"

    def _log(self, hook: str, **entry: Any) -> None:
        _note(os.environ.get("KSTORE_TEST_HOOK_LOG"), hook=hook, worker=os.environ.get("KSTORE_TEST_WORKER_NAME"),
              t=time.time(), **entry)

    def setup(self) -> None:
        self._log("setup", engine=self.engine is not None)

    def teardown(self) -> None:
        self._log("teardown")

    def on_assigned(self, partitions: list[tuple[str, int]]) -> None:
        self._log("on_assigned", partitions=sorted(partitions))

    def on_revoked(self, partitions: list[tuple[str, int]]) -> None:
        self._log("on_revoked", partitions=sorted(partitions))

    def on_committed(self, msgs: Sequence[Message]) -> None:
        self._log("on_committed", offsets=[[m.topic, m.partition, m.offset] for m in msgs])

    def handle(self, msg: Message) -> None:
        self._log("handle", tp=[msg.topic, msg.partition], offset=msg.offset)
        self.session.execute(INSERT_TEXT, _row(msg, worker=os.environ.get("KSTORE_TEST_WORKER_NAME", "h")))


class CommitsItself(Processor):
    """Writes its row, then calls ``self.session.commit()``. Right after that commit it counts, on
    another connection of ``self.engine``, whether its row is visible there (noted in
    ``KSTORE_TEST_NOTES``). A message whose value starts with "fail" raises after its commit."""

    group = "commits-itself"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        self.session.execute(INSERT_TEXT, _row(msg))
        self.session.commit()
        with self.engine.connect() as other:
            seen = other.execute(sa.text("SELECT count(*) FROM effects WHERE topic = :t AND kafka_offset = :o"),
                                 {"t": msg.topic, "o": msg.offset}).scalar_one()
        _note(os.environ.get("KSTORE_TEST_NOTES"), offset=msg.offset, visible_elsewhere=seen)
        if msg.value.startswith("fail"):
            raise ValueError(f"failed after its own commit: {msg.value!r}")


UNIQUE_DDL = "CREATE TABLE IF NOT EXISTS promise_unique (k VARCHAR(64) PRIMARY KEY)"


class Immediate(Processor):
    """``defer_inserts = False``: each message inserts its value into a table with a unique key and
    catches a duplicate's IntegrityError in handle() (noted in ``KSTORE_TEST_NOTES``); then it
    writes its effect row, whose value says "inserted" or "duplicate". (On SQLite the transaction
    survives the caught error; on PostgreSQL it is aborted, so the effect row's INSERT fails.)"""

    group = "immediate"
    value_format = "str"
    defer_inserts = False

    def setup(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(UNIQUE_DDL))

    def handle(self, msg: Message) -> None:
        outcome = "inserted"
        try:
            self.session.execute(sa.text("INSERT INTO promise_unique (k) VALUES (:k)"), {"k": msg.value})
        except IntegrityError as exc:
            _note(os.environ.get("KSTORE_TEST_NOTES"), offset=msg.offset, caught=type(exc).__name__)
            outcome = "duplicate"
        self.session.execute(INSERT_TEXT, _row(msg, value=f"{msg.value}:{outcome}"))


class Deferred(Immediate):
    """The same as :class:`Immediate` with kstore's default deferred INSERTs."""

    group = "deferred"
    defer_inserts = True


class Parsed:
    """What :class:`OwnDeserializer` turns a record into: not a str, bytes or JSON value."""

    def __init__(self, fields: dict[str, str]) -> None:
        self.fields = fields


class OwnDeserializer(Processor):
    """Overrides ``deserialize()``: a value ``a=1;b=2`` becomes a :class:`Parsed`, the key is
    reversed text; a value without "=" raises ``ValueError`` from deserialize() itself."""

    group = "own-deserializer"

    def deserialize(self, key: bytes | None, value: bytes | None) -> tuple[Any, Any]:
        text = (value or b"").decode()
        if "=" not in text:
            raise ValueError(f"not key=value pairs: {text!r}")
        fields = dict(pair.split("=", 1) for pair in text.split(";"))
        return (None if key is None else key.decode()[::-1]), Parsed(fields)

    def handle(self, msg: Message) -> None:
        assert isinstance(msg.value, Parsed), f"deserialize() was not used: {msg.value!r}"
        self.session.execute(INSERT_TEXT, _row(msg, value=f"{msg.key}|{json.dumps(msg.value.fields, sort_keys=True)}"))


class Contended(Processor):
    """Each message updates rows of ``promise_counter`` (the table the test made) and writes its
    effect row. ``KSTORE_TEST_CONTEND`` says how:

    - ``lock``: ``SET LOCAL lock_timeout`` to ``KSTORE_TEST_LOCK_TIMEOUT_MS``, then UPDATE row 1
      (which the test holds locked for a while): a lock timeout (55P03) until it is released.
    - ``deadlock``: UPDATE row 1, then row 2 (the test holds row 2 and then asks for row 1).
    - ``serialize``: REPEATABLE READ, read row 1, note it in ``KSTORE_TEST_NOTES`` and wait while
      ``KSTORE_TEST_WAIT_FILE`` exists (the test updates row 1 meanwhile), then UPDATE row 1: a
      serialization failure (40001) the first time.
    Every attempt is noted in ``KSTORE_TEST_NOTES``.
    """

    group = "contended"
    value_format = "str"

    def handle(self, msg: Message) -> None:
        how = os.environ.get("KSTORE_TEST_CONTEND", "lock")
        notes = os.environ.get("KSTORE_TEST_NOTES")
        _note(notes, attempt=msg.offset, how=how)
        execute = self.session.execute
        if how == "lock":
            execute(sa.text(f"SET LOCAL lock_timeout = {int(os.environ.get('KSTORE_TEST_LOCK_TIMEOUT_MS', '300'))}"))
            execute(sa.text("UPDATE promise_counter SET n = n + 1 WHERE id = 1"))
        elif how == "deadlock":
            execute(sa.text("UPDATE promise_counter SET n = n + 1 WHERE id = 1"))
            execute(sa.text("UPDATE promise_counter SET n = n + 1 WHERE id = 2"))
        else:
            execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            execute(sa.text("SELECT n FROM promise_counter WHERE id = 1")).scalar_one()
            _note(notes, snapshot=msg.offset)
            wait_file = os.environ.get("KSTORE_TEST_WAIT_FILE")
            while wait_file and Path(wait_file).exists():
                time.sleep(0.02)
            execute(sa.text("UPDATE promise_counter SET n = n + 1 WHERE id = 1"))
        execute(INSERT_TEXT, _row(msg))


class LocksItsOffsetRow(Processor):
    """Writes one effect row per message; in the batch holding offset ``KSTORE_TEST_HANG_AT`` it
    also takes its partition's offsets row lock (``SELECT ... FOR UPDATE``, the lock its commit's
    UPDATE takes), creates ``KSTORE_TEST_HANG_FILE`` and sleeps: a test then SIGSTOPs it, a zombie
    inside its transaction holding the row a new owner's claim must lock."""

    group = "locks-its-row"
    value_format = "str"

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        name = os.environ.get("KSTORE_TEST_WORKER_NAME", "z")
        for msg in msgs:
            self.session.execute(INSERT_TEXT, _row(msg, worker=name))
        hang_at, hang_file = int(os.environ.get("KSTORE_TEST_HANG_AT", "-1")), os.environ.get("KSTORE_TEST_HANG_FILE")
        if hang_file and not Path(hang_file).exists() and any(m.offset == hang_at for m in msgs):
            self.session.execute(sa.text(
                "SELECT next_offset FROM kstore_offsets WHERE topic = :t AND partition_id = :p FOR UPDATE"),
                {"t": msgs[0].topic, "p": msgs[0].partition})
            Path(hang_file).write_text(",".join(str(m.offset) for m in msgs))
            time.sleep(3600)
