"""The processor's hooks, through real `kstore worker` processes and a rebalance: `setup()` first,
`on_assigned(partitions)` before a partition's first message, `on_revoked(partitions)` when a
second worker joins, `on_committed(msgs)` after each commit, `teardown()` last."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.harness import assert_exactly_once, effects, wait_until

HOOKS = "promise_processors:HookLog"


def hook_calls(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assigned_sets(calls: list[dict[str, Any]]) -> list[set[tuple[str, int]]]:
    return [{(t, p) for t, p in c["partitions"]} for c in calls if c["hook"] == "on_assigned"]


def holding(calls: list[dict[str, Any]]) -> set[tuple[str, int]]:
    """The partitions a worker's hooks say it holds: assigned, and not revoked since."""
    held: set[tuple[str, int]] = set()
    for c in calls:
        if c["hook"] == "on_assigned":
            held |= {(t, p) for t, p in c["partitions"]}
        elif c["hook"] == "on_revoked":
            held -= {(t, p) for t, p in c["partitions"]}
    return held


def rebalanced(calls: list[dict[str, Any]]) -> float:
    """When the worker's last rebalance hook before its shutdown was called (a stopping worker's
    own on_revoked comes after its last handle)."""
    last_handle = max(c["t"] for c in calls if c["hook"] == "handle")
    return max(c["t"] for c in calls if c["hook"] in ("on_assigned", "on_revoked") and c["t"] <= last_handle)


def check_order(calls: list[dict[str, Any]]) -> None:
    """setup first, teardown last, and every message handled only while its partition was
    assigned (after an on_assigned that named it, with no on_revoked of it since)."""
    assert calls[0]["hook"] == "setup" and calls[0]["engine"], calls[:3]
    assert calls[-1]["hook"] == "teardown", calls[-3:]
    assert [c["hook"] for c in calls].count("setup") == 1
    assert [c["hook"] for c in calls].count("teardown") == 1
    held: set[tuple[str, int]] = set()
    for c in calls:
        if c["hook"] == "on_assigned":
            assert all(isinstance(t, str) and isinstance(p, int) for t, p in c["partitions"])
            held |= {(t, p) for t, p in c["partitions"]}
        elif c["hook"] == "on_revoked":
            held -= {(t, p) for t, p in c["partitions"]}
        elif c["hook"] == "handle":
            tp = (c["tp"][0], c["tp"][1])
            assert tp in held, f"{tp} offset {c['offset']} handled while not assigned (held: {sorted(held)})"


def test_hooks_are_called_in_order_across_a_rebalance(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    topic = new_topic(partitions=4)
    logs = [tmp_path / "w1.hooks", tmp_path / "w2.hooks"]
    w1 = workers(pg_dsn, topic, "hooks", HOOKS, env={"KSTORE_TEST_HOOK_LOG": str(logs[0])})
    sent = [m for p in range(4) for m in produce(topic, (f"a{p}-{i}" for i in range(20)), partition=p)]
    wait_until(lambda: len(effects(pg_dsn)) >= 80, 90, what="the first 80 effects")
    first = assigned_sets(hook_calls(logs[0]))
    assert first == [{(topic, p) for p in range(4)}], first

    w2 = workers(pg_dsn, topic, "hooks", HOOKS, env={"KSTORE_TEST_HOOK_LOG": str(logs[1])})
    # Eager (kafka-python): w1 gives back all four, then keeps two. Cooperative (confluent): w1 gives
    # back only the two that move. Either way w2 gets those two, and w1 holds the others.
    # (Each worker calls its hooks on its own thread: w2's on_assigned may come before w1's on_revoked.)
    everything = {(topic, p) for p in range(4)}

    def split() -> tuple[set[tuple[str, int]], set[tuple[str, int]]] | None:
        kept, taken = holding(hook_calls(logs[0])), holding(hook_calls(logs[1]))
        return (kept, taken) if kept and taken and not kept & taken and kept | taken == everything else None

    kept, taken = wait_until(split, 90, what="the rebalance's hooks in both workers")
    revoked = [c for c in hook_calls(logs[0]) if c["hook"] == "on_revoked"]
    assert revoked and taken <= {(t, p) for t, p in revoked[0]["partitions"]}, revoked

    sent += [m for p in range(4) for m in produce(topic, (f"b{p}-{i}" for i in range(20)), partition=p)]
    wait_until(lambda: len(effects(pg_dsn)) >= 160, 90, what="all 160 effects")
    assert w2.terminate() == 0 and w1.terminate() == 0
    assert_exactly_once(effects(pg_dsn), set(sent))

    every_commit: list[tuple[str, int, int]] = []
    for path, last in zip(logs, (kept, taken), strict=True):
        calls = hook_calls(path)
        check_order(calls)
        # After the rebalance, each worker handled only the partitions it then held.
        since = rebalanced(calls)
        handled_since = {(c["tp"][0], c["tp"][1]) for c in calls if c["hook"] == "handle" and c["t"] > since}
        assert handled_since and handled_since <= last, (handled_since, last)
        # on_committed follows each commit with that batch's messages: only messages this worker
        # handled (a batch cut short by the rebalance is handled again, and committed once).
        committed = [(t, p, o) for c in calls if c["hook"] == "on_committed" for t, p, o in c["offsets"]]
        assert set(committed) <= {(*c["tp"], c["offset"]) for c in calls if c["hook"] == "handle"}
        every_commit += committed
    # Together, every message was in exactly one on_committed call (no worker crashed).
    assert sorted(every_commit) == sorted(sent)
