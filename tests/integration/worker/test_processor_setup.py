"""A processor's ``setup()``: run one at a time per group, so workers that start together never
race each other's ``CREATE TABLE IF NOT EXISTS``; a setup that fails stops the start in one line."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Message, Processor, Settings
from kstore.db.setuplock import setup_lock
from kstore.db.store import make_engine
from kstore.engine.worker import Worker
from kstore.errors import ProcessorError
from kstore.running.hooks import call_setup
from kstore.testing import run_batch
from tests.integration.cli.test_cli import kstore
from tests.support.harness import wait_until

#: Processes (threads here) starting setup() at the same moment, and how many times.
RACERS = 6
ROUNDS = 20
TABLES = 4


class CreatesTables(Processor):
    """setup() creates its tables as the examples do, ``IF NOT EXISTS``, in one transaction."""

    def __init__(self, round_: int) -> None:
        self.round = round_

    def setup(self) -> None:
        with self.engine.begin() as conn:
            for i in range(TABLES):
                name = f"race_{self.round}_{i}"
                conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {name} (id bigint PRIMARY KEY, note text)"))
                conn.execute(sa.text(f"CREATE INDEX IF NOT EXISTS {name}_note ON {name} (note)"))

    def handle(self, msg: Message) -> None:
        pass


def _as_worker(processor: Processor, engine: sa.Engine, group: str) -> None:
    call_setup(processor, engine, group)  # what Worker.start and a dead letter's replay call


def _as_test_helper(processor: Processor, engine: sa.Engine, group: str) -> None:
    processor.group = group  # type: ignore[misc]  # the lock's key, as a worker's
    run_batch(processor, [], engine)


def _race(engines: list[sa.Engine], run: Callable[[sa.Engine], None]) -> list[BaseException]:
    """``run(engine)`` on a thread per engine, all let go at once; what they raised."""
    barrier = threading.Barrier(len(engines))
    errors: list[BaseException] = []

    def racer(engine: sa.Engine) -> None:
        barrier.wait()
        try:
            run(engine)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=racer, args=(engine,)) for engine in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.integration
@pytest.mark.parametrize("start", [_as_worker, _as_test_helper], ids=["worker", "testing"])
def test_setups_started_together_never_race(pg_dsn: str, start: Callable[[Processor, sa.Engine, str], None]) -> None:
    """RACERS setups of one group let go at the same instant, ROUNDS times: every one succeeds
    (without the lock PostgreSQL fails some with a unique violation on pg_type_typname_nsp_index)."""
    engines = [make_engine(Settings(dsn=pg_dsn)) for _ in range(RACERS)]
    try:
        for engine in engines:  # connected beforehand, so the start line is the barrier
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        for round_ in range(ROUNDS):
            errors = _race(engines, lambda engine, r=round_: start(CreatesTables(r), engine, f"racers-{r}"))
            assert not errors, f"round {round_}: {len(errors)} of {RACERS} setups failed: {errors[0]!r}"
    finally:
        for engine in engines:
            engine.dispose()


@pytest.mark.integration
def test_the_lock_is_released_when_setup_raises(pg_dsn: str) -> None:
    engine = make_engine(Settings(dsn=pg_dsn))

    class Broken(Processor):
        def setup(self) -> None:
            raise RuntimeError("no tables today")

    try:
        with pytest.raises(ProcessorError, match=r"Broken.setup\(\) failed: RuntimeError: no tables today"):
            call_setup(Broken(), engine, "broken")
        with engine.connect() as conn:
            held = conn.execute(sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")).scalar_one()
        assert held == 0
        with setup_lock(engine, "broken"):  # and it can be taken again at once
            pass
    finally:
        engine.dispose()


class SetupSignals(Processor):
    group = "setup-waits"

    def __init__(self) -> None:
        self.ran = threading.Event()

    def setup(self) -> None:
        self.ran.set()

    def handle(self, msg: Message) -> None:
        pass


@pytest.mark.integration
def test_a_worker_runs_setup_only_under_its_groups_lock(pg_dsn: str, kafka: str, new_topic: Any,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """While another holds the group's setup lock, a starting worker waits (and says so); it runs
    setup() once the lock is let go."""
    topic = new_topic(partitions=1)
    processor = SetupSignals()
    worker = Worker(processor, Settings(dsn=pg_dsn, bootstrap_servers=kafka, topics=(topic,)))
    engine = make_engine(Settings(dsn=pg_dsn))
    caplog.set_level(logging.INFO, logger="kstore.db.setuplock")
    failed: list[BaseException] = []

    def start() -> None:
        try:
            worker.start()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=start)
    try:
        with setup_lock(engine, "setup-waits"):
            thread.start()
            wait_until(lambda: "to finish its processor's setup()" in caplog.text or failed,
                       what="the worker waiting for the setup lock")
            assert not failed, failed
            assert not processor.ran.is_set()
        thread.join(60)
        assert not failed, failed
        assert processor.ran.is_set()
    finally:
        thread.join(60)
        worker.close()
        engine.dispose()


@pytest.mark.integration
def test_a_worker_whose_setup_fails_says_so_in_one_line(sqlite_dsn: str, kafka: str, new_topic: Any) -> None:
    topic = new_topic(partitions=1)
    r = kstore("--log-level", "WARNING", "worker", "processors:FailingSetup", "--dsn", sqlite_dsn,
               "--bootstrap-servers", kafka, "--topic", topic)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines == ["kstore: error: FailingSetup.setup() failed: OperationalError: no such table: no_such_table"], \
        r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    debug = kstore("--debug", "worker", "processors:FailingSetup", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka,
                   "--topic", topic)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "no_such_table" in debug.stderr
