"""Running a processor (kstore.running.handler) when one processor object is shared by two threads,
on SQLite: a batch of it runs in one thread at a time
(a second thread's ``run_handler`` is refused before it runs), and replays through it run one after
the other, each between its own ``setup`` and ``teardown``; one that waits too long is refused."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from kstore import Message, Processor, Settings
from kstore.db.deadletters import DeadLetterBusyError, show_dead_letter
from kstore.errors import ProcessorContractError
from kstore.ops import replay as replays
from kstore.running.handler import run_handler
from kstore.testing import make_message
from tests.support.harness import wait_until
from tests.support.processors import effects
from tests.support.replay_processors import LOG_ENV, SlowReplay, dead_letter, steps, when


class Waits(Processor):
    """Writes one effect row per message; the message at offset 0 waits for ``release`` first."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def handle(self, msg: Message) -> None:
        if msg.offset == 0:
            self.entered.set()
            assert self.release.wait(10)
        self.session.execute(sa.insert(effects).values(topic="t", partition_id=0, kafka_offset=msg.offset))


def _offsets(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(effects.c.kafka_offset).order_by(effects.c.kafka_offset)).scalars())


def _batch(engine: sa.Engine, processor: Processor, offset: int) -> None:
    with engine.begin() as conn:
        run_handler(processor, conn, [make_message(b"", offset=offset)])


def test_a_second_thread_running_a_batch_of_the_same_processor_is_refused_and_writes_nothing(
        sqlite_dsn: str) -> None:
    engine, processor = sa.create_engine(sqlite_dsn), Waits()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_batch, engine, processor, 0)
        assert processor.entered.wait(10)
        try:
            with pytest.raises(ProcessorContractError, match="a Processor runs one batch at a time; give each "
                                                             "thread its own processor"):
                _batch(engine, processor, 1)
        finally:
            processor.release.set()
        first.result(10)
    assert _offsets(engine) == [0], "the refused batch wrote nothing, the running one all it wrote"
    _batch(engine, processor, 2)  # once the first has finished, another thread's batch runs
    assert _offsets(engine) == [0, 2]
    engine.dispose()


@pytest.fixture
def replay_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "replays.log"
    monkeypatch.setenv(LOG_ENV, str(path))
    return path


def _replay(settings: Settings, processor: SlowReplay, letter: int) -> tuple[float, replays.ReplayResult]:
    started = time.time()
    return started, replays.replay_dead_letters(settings, processor, SlowReplay.group, [letter])


def test_two_replays_through_one_processor_in_two_threads_run_one_after_the_other(
        sqlite_dsn: str, replay_log: Path) -> None:
    a, b = dead_letter(sqlite_dsn, {"n": 1, "hold": 1.5}), dead_letter(sqlite_dsn, {"n": 2, "hold": 0.2})
    settings, processor = Settings(dsn=sqlite_dsn, bootstrap_servers="127.0.0.1:1"), SlowReplay()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_replay, settings, processor, a)
        wait_until(lambda: any(s.what == "start" for s in steps(replay_log)), 30, what="the first replay's handler")
        second = pool.submit(_replay, settings, processor, b)
        (_, done_a), (asked_b, done_b) = first.result(30), second.result(30)
    assert (done_a.replayed, done_a.failed, done_b.replayed, done_b.failed) == ([a], {}, [b], {})
    found = steps(replay_log)
    assert asked_b < when(found, "end", 1), "the second replay was asked for while the first one's handler ran"
    assert [(s.what, s.n) for s in found] == [("setup", None), ("start", 1), ("end", 1), ("teardown", None),
                                              ("setup", None), ("start", 2), ("end", 2), ("teardown", None)]
    engine = sa.create_engine(sqlite_dsn)
    assert _offsets(engine) == [1, 2]
    engine.dispose()


def test_a_replay_that_waits_past_the_limit_for_the_processor_is_refused_and_replays_nothing(
        sqlite_dsn: str, replay_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replays, "BUSY_WAIT_S", 0.3)
    a, b = dead_letter(sqlite_dsn, {"n": 1, "hold": 1.5}), dead_letter(sqlite_dsn, {"n": 2})
    settings, processor = Settings(dsn=sqlite_dsn, bootstrap_servers="127.0.0.1:1"), SlowReplay()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_replay, settings, processor, a)
        wait_until(lambda: any(s.what == "start" for s in steps(replay_log)), 30, what="the first replay's handler")
        with pytest.raises(DeadLetterBusyError, match="another replay through the processor of group 'replays' "
                                                      r"\(SlowReplay\) is running: try again when it has finished; "
                                                      "nothing was replayed"):
            replays.replay_dead_letters(settings, processor, SlowReplay.group, [b])
        assert first.result(30)[1].replayed == [a]
    letter, history = show_dead_letter(settings, b)
    assert (letter.status, letter.attempts, history) == ("dead", 1, []), "untouched: not even a failure noted"
    assert [s.n for s in steps(replay_log) if s.what == "start"] == [1]
    assert replays.replay_dead_letters(settings, processor, SlowReplay.group, [b]).replayed == [b]  # free again
