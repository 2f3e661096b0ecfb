"""A processor to replay dead letters through from several operators (or threads) at once: its handler
takes its time, so replays overlap, and says when each step ran.

Values are JSON: ``{"n": N, "hold": S, "early": true, "fail": true}``. ``handle`` writes one effect row
(``effects``, value ``N``) and waits ``hold`` seconds: after the row with ``early``, before it without;
with ``fail`` it then raises. ``setup`` and ``teardown`` open and close the processor as a worker's
life would, and a message handled while it is closed fails.

Each step is a line of ``KSTORE_TEST_REPLAY_LOG`` (when set): the time, the step, the message's ``n``.
A test reads it with :func:`steps`, whether the replays ran in its own process (the console through
Starlette's test client, a thread) or in another (``kstore console``, ``kstore dead-letters replay``).
Imported as ``replay_processors`` by those processes, and as ``tests.support.replay_processors`` in a test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa

from kstore import Message, Processor
from kstore.db.deadletters import DEAD, build_table
from tests.support.processors import effects

LOG_ENV = "KSTORE_TEST_REPLAY_LOG"
_log_lock = threading.Lock()


class Step(NamedTuple):
    at: float
    what: str  # setup, start, end, teardown
    n: int | None
    pid: int


def note(what: str, n: int | None = None) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    with _log_lock, open(path, "a") as log:
        log.write(f"{time.time():.6f} {what} {'-' if n is None else n} {os.getpid()}\n")


def steps(path: Path) -> list[Step]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        at, what, n, pid = line.split()
        found.append(Step(float(at), what, None if n == "-" else int(n), int(pid)))
    return found


def when(found: list[Step], what: str, n: int | None = None) -> float:
    """When the one ``what`` step of message ``n`` ran (every message is handled once in these tests)."""
    [at] = [s.at for s in found if s.what == what and s.n == n]
    return at


def effect_counts(dsn: str) -> Counter[int]:
    """How many times each value's effect landed (the processors here write one row a replay)."""
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        values = conn.execute(sa.text("SELECT value FROM effects")).scalars().all()
    engine.dispose()
    return Counter(int(v) for v in values)


def dead_letter(dsn: str, value: dict[str, Any], topic: str = "orders") -> int:
    """A dead letter of ``SlowReplay``'s group, its offset ``value["n"]``, waiting to be replayed."""
    t = build_table()
    stamp = datetime.now(timezone.utc)
    engine = sa.create_engine(dsn)
    try:
        with engine.begin() as conn:
            return int(conn.execute(t.insert().returning(t.c.id), {
                "consumer_group": SlowReplay.group, "topic": topic, "partition_id": 0, "offset": value["n"],
                "key": None, "value": json.dumps(value).encode(), "headers": "[]", "timestamp": stamp,
                "error": "ValueError: bad order", "traceback": "Traceback ...", "attempts": 1,
                "first_failure_at": stamp, "last_failure_at": stamp, "status": DEAD}).scalar_one())
    finally:
        engine.dispose()


class SlowReplay(Processor):
    group = "replays"
    value_format = "json"
    opened = False

    def setup(self) -> None:
        note("setup")
        self.opened = True

    def teardown(self) -> None:
        note("teardown")
        self.opened = False

    def handle(self, msg: Message) -> None:
        n, hold = msg.value["n"], float(msg.value.get("hold", 0))
        note("start", n)
        if msg.value.get("early"):
            self._effect(msg, n)
        time.sleep(hold)
        if not msg.value.get("early"):
            self._effect(msg, n)
        note("end", n)
        if msg.value.get("fail"):
            raise RuntimeError(f"order {n} failed on purpose")

    def _effect(self, msg: Message, n: int) -> None:
        if not self.opened:
            raise RuntimeError(f"order {n} handled after the processor's teardown")
        self.session.execute(sa.insert(effects).values(
            topic=msg.topic, partition_id=msg.partition, kafka_offset=msg.offset, value=str(n), worker="replay"))
