"""How soon a live `kstore worker` picks up an online `kstore offsets set --execute` on an idle
partition: the worker checks its partitions' epochs every `epoch_check_interval_s` (1 s), so the
reset is noticed about a second after it is written, and replayed soon after."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.harness import REPO_DIR, effects, stored_offsets, wait_until

#: What the seam between the engine and a Kafka client promises: on each client.
pytestmark = [pytest.mark.contract, pytest.mark.usefixtures("kafka_client")]


TRIALS = 6
NOTICED = r"^(\S+ \S+) INFO kstore\.\S+: \S+ was reset to 9 by an operator"
#: What a loaded 2-core machine meets with room to spare (the check itself is every 1 s).
BOUND_S = 5.0


def test_an_online_reset_of_an_idle_partition_is_picked_up_within_seconds(
    pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
    workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=1)
    produce(topic, (f"v{i}" for i in range(10)), partition=0)
    w = workers(pg_dsn, topic, f"pickup-{topic}")
    wait_until(lambda: stored_offsets(pg_dsn, f"pickup-{topic}") == {(topic, 0): 10}, 60, what="offset 10 stored")
    noticed, replayed = [], []
    for trial in range(TRIALS):
        seen = len(re.findall(NOTICED, w.log, re.M))
        r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "set", "--group", f"pickup-{topic}",
                            "--topic", topic, "--partition", "0", "--to-offset", "9", "--execute", "--dsn", pg_dsn,
                            "--bootstrap-servers", kafka, "--reason", f"pick-up trial {trial}"],
                           cwd=REPO_DIR, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        # Timed from the reset's own record (written just before its COMMIT), not from the
        # command's exit: the command takes about a second to leave after its COMMIT.
        applied = reset_at(pg_dsn, f"kstore offsets set: pick-up trial {trial}")
        wait_until(lambda seen=seen: len(re.findall(NOTICED, w.log, re.M)) > seen, 30, interval=0.02,
                   what="the worker to notice the reset")
        logged = re.findall(NOTICED, w.log, re.M)[-1]
        noticed.append(datetime.strptime(logged, "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp() - applied)
        wait_until(lambda trial=trial: effects(pg_dsn)[(topic, 0, 9)] == trial + 2, 30, interval=0.02,
                   what="the replay")
        replayed.append(time.time() - applied)  # at most: the wait started after the command returned
        wait_until(lambda: stored_offsets(pg_dsn, f"pickup-{topic}") == {(topic, 0): 10}, 30, what="offset 10 again")
        time.sleep(0.37 * (trial % 3))  # spread the resets over the worker's check period
    assert w.terminate() == 0
    print(f"reset noticed after {', '.join(f'{s:.2f}' for s in noticed)} s (median {statistics.median(noticed):.2f}); "
          f"replayed after {', '.join(f'{s:.2f}' for s in replayed)} s")
    assert max(noticed) < BOUND_S and max(replayed) < BOUND_S, (noticed, replayed)
    # Every message before the reset point landed once; the reset one once per trial, plus the first time.
    counts = effects(pg_dsn)
    assert all(counts[(topic, 0, o)] == 1 for o in range(9)) and counts[(topic, 0, 9)] == TRIALS + 1
    assert w.log.count("claimed ") == 1, "picked up without a restart or a rebalance"


def reset_at(dsn: str, reason: str) -> float:
    """When the reset with that reason was written (kstore_offset_history.at), as a Unix time."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            at: datetime = conn.execute(sa.text("SELECT at FROM kstore_offset_history WHERE reason = :r"),
                                        {"r": reason}).scalar_one()
    finally:
        engine.dispose()
    return at.timestamp()
