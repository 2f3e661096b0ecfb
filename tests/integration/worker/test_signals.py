"""Signals to a real `kstore worker`: the first SIGINT finishes the batch in flight, commits it and
exits 0; a second SIGINT stops at once (exit 130) and the batch rolls back; SIGUSR1 prints every
thread's stack to stderr and the worker carries on."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.harness import assert_exactly_once, effects, read_in_flight, stored_offsets, wait_until


def hang_env(tmp_path: Path, seconds: float) -> tuple[Path, dict[str, str]]:
    """The Recorder writes (and flushes) the batch holding offset 0, then sleeps ``seconds``."""
    hang = tmp_path / "hang"
    return hang, {"KSTORE_TEST_HANG_AT": "0", "KSTORE_TEST_HANG_FILE": str(hang),
                  "KSTORE_TEST_HANG_SECONDS": str(seconds)}


def test_first_sigint_finishes_the_batch_in_flight_commits_it_and_exits_0(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    topic = new_topic(partitions=1)
    sent = produce(topic, (f"v{i}" for i in range(20)), partition=0)
    hang, env = hang_env(tmp_path, 4)
    w = workers(pg_dsn, topic, "sigint", env=env)
    wait_until(hang.exists, 60, what="the batch in flight (written, not committed)")
    in_flight = read_in_flight(hang)
    w.proc.send_signal(signal.SIGINT)
    w.wait_for_log(r"SIGINT received: finishing the batch in flight")
    assert w.wait(60) == 0
    assert "second stop signal" not in w.log and "rolled back" not in w.log
    assert re.search(r"worker for group 'sigint' stopped", w.log)
    # The batch in flight committed with its offsets, and nothing after it was taken.
    end = max(o for _t, _p, o in in_flight) + 1
    assert stored_offsets(pg_dsn, "sigint") == {(topic, 0): end}
    assert_exactly_once(effects(pg_dsn), in_flight)
    assert in_flight == {m for m in sent if m[2] < end}


def test_second_sigint_stops_at_once_with_exit_130_and_rolls_the_batch_back(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(20)), partition=0)
    hang, env = hang_env(tmp_path, 3600)
    w = workers(pg_dsn, topic, "sigint2", env=env)
    wait_until(hang.exists, 60, what="the batch in flight (written, not committed)")
    assert effects(pg_dsn) == {}  # written and flushed inside its transaction: not visible outside
    w.proc.send_signal(signal.SIGINT)
    w.wait_for_log(r"SIGINT received: finishing the batch in flight")
    w.proc.send_signal(signal.SIGINT)
    assert w.wait(30) == 130
    assert "second stop signal: stopped at once; the batch in flight was rolled back" in w.log
    assert effects(pg_dsn) == {}
    assert stored_offsets(pg_dsn, "sigint2").get((topic, 0)) in (None, 0)


def test_sigusr1_prints_every_threads_stack_and_the_worker_carries_on(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=2)
    first = [m for p in range(2) for m in produce(topic, (f"a{i}" for i in range(10)), partition=p)]
    w = workers(pg_dsn, topic, "usr1")
    wait_until(lambda: len(effects(pg_dsn)) == 20, 60, what="the first 20 effects")
    w.proc.send_signal(signal.SIGUSR1)
    w.wait_for_log(r"Current thread 0x")
    dump = w.log[w.log.index("(most recent call first)") - 40:]
    # Every thread: the main loop, kstore's fetch thread and kafka-python's IO thread at least.
    assert len(re.findall(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", dump, re.M)) >= 3
    assert "in _fetch_loop" in dump and "in _loop" in dump
    later = [m for p in range(2) for m in produce(topic, (f"b{i}" for i in range(10)), partition=p)]
    wait_until(lambda: len(effects(pg_dsn)) == 40, 60, what="the 20 effects after the dump")
    assert w.proc.poll() is None
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), set(first + later))
