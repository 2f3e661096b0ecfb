"""Where a partition with no stored offset starts: `--start-from latest` (the log end at the claim)
and `--start-from <ISO time>` (the first record at or after that time), through `kstore worker`."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until


def test_start_from_latest_skips_what_was_there_before_the_claim(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=2)
    for p in range(2):
        produce(topic, (f"old{i}" for i in range(7)), partition=p)
    w = workers(pg_dsn, topic, "latest", args=["--start-from", "latest"])
    w.wait_for_log(r"claimed ")
    wait_until(lambda: stored_offsets(pg_dsn, "latest") == {(topic, 0): 7, (topic, 1): 7}, 30,
               what="both partitions stored at the log end")
    new = [m for p in range(2) for m in produce(topic, (f"new{i}" for i in range(5)), partition=p)]
    wait_until(lambda: len(effects(pg_dsn)) >= 10, 60, what="the 10 new messages")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), set(new))
    assert stored_offsets(pg_dsn, "latest") == {(topic, 0): 12, (topic, 1): 12}


def test_start_from_an_iso_time_starts_at_the_first_record_at_or_after_it(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=2)
    for p in range(2):
        produce(topic, (f"before{i}" for i in range(6)), partition=p)
    time.sleep(1.0)  # Kafka's CreateTime is in ms: keep a clear gap on both sides of the cut
    cut = datetime.now(timezone.utc)
    time.sleep(1.0)
    after = [m for p in range(2) for m in produce(topic, (f"after{i}" for i in range(4)), partition=p)]
    w = workers(pg_dsn, topic, "since", args=["--start-from", cut.isoformat()])
    wait_until(lambda: len(effects(pg_dsn)) >= 8, 60, what="the 8 messages after the cut")
    # Later messages are consumed normally from there.
    after += produce(topic, ["later"], partition=0)
    wait_until(lambda: len(effects(pg_dsn)) >= 9, 60, what="the message produced after the start")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), set(after))
    assert stored_offsets(pg_dsn, "since") == {(topic, 0): 11, (topic, 1): 10}
