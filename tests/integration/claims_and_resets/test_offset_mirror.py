"""Offsets mirrored to Kafka (``mirror_offsets``) for Kafka's own lag tools, and never read back.

Kafka's offsets for a kstore group (a mirror's, or a group's from before kstore)
must not move a partition: kafka-python looks them up for any assigned partition
without a position, and kstore gives each one a placeholder position in the
rebalance listener so it never does.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, OffsetAndMetadata, TopicPartition

from kstore.kafka.seam import MIRROR_METADATA, committed_metadata
from kstore_devbroker.broker import run_tool
from tests.conftest import KAFKA_CLIENT
from tests.support.harness import SUPPORT_DIR, assert_exactly_once, effects, stored_offsets, wait_until

GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"


def kafka_group_offsets(kafka: str, group: str) -> dict[tuple[str, int], int]:
    """CURRENT-OFFSET per partition, as Kafka's own `kafka-consumer-groups.sh --describe` prints it."""
    r = run_tool(GROUP_COMMAND, "--bootstrap-server", kafka, "--describe", "--group", group)
    assert r.returncode == 0, r.stderr
    found: dict[tuple[str, int], int] = {}
    for line in r.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] == group and re.fullmatch(r"\d+", fields[3]):
            found[(fields[1], int(fields[2]))] = int(fields[3])
    return found


def test_kafkas_own_tool_shows_the_mirrored_offsets(kafka: str, pg_dsn: str, new_topic: Any, produce: Any,
                                                    workers: Any) -> None:
    topic, group = new_topic(2), "mirrored"
    sent = set(produce(topic, [f"m{i}" for i in range(400)]))
    w = workers(pg_dsn, topic, group, env={"KSTORE_MIRROR_OFFSETS": "1", "KSTORE_MAX_BATCH_SIZE": "50"})
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message processed")
    stored = stored_offsets(pg_dsn, group)
    wait_until(lambda: kafka_group_offsets(kafka, group) == stored, 30, interval=1,
               what="Kafka's committed offsets equal to the database's")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)


def test_kafka_offsets_ahead_or_behind_the_database_change_nothing(kafka: str, pg_dsn: str, new_topic: Any,
                                                                   produce: Any, workers: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The group's offsets in Kafka are tampered with (one partition back to 0, one far ahead):
    the next worker still starts every partition at the database's offset, and kafka-python
    never even looks Kafka's offsets up (its debug log says so when it does)."""
    topic, group = new_topic(2), "tampered"
    first = set(produce(topic, [f"a{i}" for i in range(300)]))
    w = workers(pg_dsn, topic, group, env={"KSTORE_MIRROR_OFFSETS": "1"})
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the first messages")
    assert w.terminate() == 0
    stored = stored_offsets(pg_dsn, group)
    admin = KafkaAdminClient(bootstrap_servers=kafka)
    try:
        admin.alter_group_offsets(group, {TopicPartition(topic, 0): OffsetAndMetadata(0, "tampered", -1),
                                          TopicPartition(topic, 1): OffsetAndMetadata(
                                              stored[(topic, 1)] + 120, "tampered", -1)})
    finally:
        admin.close()
    assert kafka_group_offsets(kafka, group) == {(topic, 0): 0, (topic, 1): stored[(topic, 1)] + 120}
    second = set(produce(topic, [f"b{i}" for i in range(300)]))
    # librdkafka logs only what its `debug` property names: the group's and the partitions' doings.
    debug = {"KSTORE_KAFKA_DEBUG": "cgrp,topic"} if KAFKA_CLIENT == "confluent" else {}
    w2 = workers(pg_dsn, topic, group, env={"KSTORE_DEBUG": "1", **debug})
    wait_until(lambda: len(effects(pg_dsn)) >= len(first) + len(second), 60, what="the later messages")
    assert w2.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | second)
    if KAFKA_CLIENT == "confluent":
        # librdkafka sought each partition to the database's offset, and never asked for Kafka's
        # committed offsets (it logs each such request, and its answer, as OFFSETFETCH).
        for (t, p), offset in stored.items():
            assert f"Seek {t} [{p}] to offset {offset} (" in w2.log
        assert "OFFSETFETCH" not in w2.log
        return
    # kafka-python's debug log is in the worker's: it sought each partition to the database's offset ...
    for (t, p), offset in stored.items():
        assert f"Seeking to offset {offset} for partition TopicPartition(topic='{t}', partition={p})" in w2.log
    # ... and never took a position from Kafka's offsets, which it logs thus (shown by a plain consumer).
    committed, reset = plain_consumer_positions(kafka, group, topic, caplog)
    assert committed == 0 and reset == 0
    assert "to the committed offset" in caplog.text and "to the committed offset" not in w2.log
    assert "Resetting offset for partition" in caplog.text and "Resetting offset for partition" not in w2.log


def plain_consumer_positions(kafka: str, group: str, topic: str, caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """Partition 0's position for a plain kafka-python consumer of ``group`` (Kafka's committed
    offset) and of no group (its own reset to the earliest), with kafka-python's log captured."""
    positions = []
    with caplog.at_level(logging.DEBUG, logger="kafka"):
        for group_id in (group, None):
            consumer = KafkaConsumer(bootstrap_servers=kafka, group_id=group_id, enable_auto_commit=False,
                                     auto_offset_reset="earliest")
            try:
                consumer.assign([TopicPartition(topic, 0)])
                positions.append(consumer.position(TopicPartition(topic, 0)))
            finally:
                consumer.close(autocommit=False)
    return positions[0], positions[1]


def committed_in_kafka(kafka: str, group: str) -> dict[tuple[str, int], tuple[int, str]]:
    """The group's committed offsets in Kafka, with their metadata (quicker than Kafka's own tool)."""
    admin = KafkaAdminClient(bootstrap_servers=kafka)
    try:
        found = admin.list_group_offsets({group: None}).get(group, {})
    finally:
        admin.close()
    return {(tp.topic, tp.partition): (o.offset, committed_metadata(o)) for tp, o in found.items() if o.offset >= 0}


def offsets_set(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kstore", "offsets", "set", *args], capture_output=True, text=True,
                          timeout=120, cwd=SUPPORT_DIR,
                          env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR), **(env or {})})


def test_an_operators_move_with_no_worker_running_moves_the_mirror_too(kafka: str, pg_dsn: str, new_topic: Any,
                                                                         produce: Any, workers: Any) -> None:
    """With no worker live, `kstore offsets set --execute` of a mirrored group also moves its
    committed offsets in Kafka: a lag dashboard then shows the replay waiting, instead of a group
    caught up. A group that does not mirror is left alone there."""
    topic, group = new_topic(2), "mirrored-replay"
    sent = produce(topic, [f"r{i}" for i in range(200)])
    w = workers(pg_dsn, topic, group, env={"KSTORE_MIRROR_OFFSETS": "1"})
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="every message processed")
    stored = stored_offsets(pg_dsn, group)
    wait_until(lambda: {tp: o for tp, (o, _) in committed_in_kafka(kafka, group).items()} == stored, 30,
               what="the mirror")
    assert w.terminate() == 0

    # The operator's shell has no KSTORE_MIRROR_OFFSETS: the offsets' metadata in Kafka tells.
    base = ["--group", group, "--topic", topic, "--dsn", pg_dsn, "--bootstrap-servers", kafka]
    dry = offsets_set(*base, "--to-earliest")
    assert dry.returncode == 0 and "Kafka's committed offsets" not in dry.stdout, dry.stdout + dry.stderr
    assert {tp: o for tp, (o, _) in committed_in_kafka(kafka, group).items()} == stored, "a dry run moved them"
    r = offsets_set(*base, "--partition", "0", "--to-earliest", "--reason", "replay", "--execute")
    assert r.returncode == 0, r.stderr
    assert f"Kafka's committed offsets of '{group}' (mirror_offsets, for lag tools) moved too" in r.stdout, r.stdout
    assert r.stderr == ""
    assert committed_in_kafka(kafka, group) == {(topic, 0): (0, MIRROR_METADATA),
                                                (topic, 1): (stored[(topic, 1)], MIRROR_METADATA)}
    # What a lag dashboard reads: Kafka's own tool shows the replay waiting on partition 0.
    assert kafka_group_offsets(kafka, group) == {(topic, 0): 0, (topic, 1): stored[(topic, 1)]}

    # A group that never mirrored: its move stays in the database.
    plain = offsets_set("--group", "plain", "--topic", topic, "--dsn", pg_dsn, "--bootstrap-servers", kafka,
                        "--to-offset", "5", "--reason", "replay", "--execute")
    assert plain.returncode == 0 and "Kafka's committed offsets" not in plain.stdout + plain.stderr, plain.stdout
    assert committed_in_kafka(kafka, "plain") == {}


def test_an_operators_move_under_a_live_worker_is_mirrored_by_the_worker(kafka: str, pg_dsn: str, new_topic: Any,
                                                                         produce: Any, workers: Any,
                                                                         tmp_path: Path) -> None:
    """With a worker live, the operator's command leaves Kafka's offsets to it (Kafka takes none from
    outside a live group): the worker mirrors the move once it has followed it, even a skip to the
    end after which it commits nothing."""
    topic, group = new_topic(1), "mirrored-skip"
    produce(topic, [f"s{i}" for i in range(100)])
    pause = tmp_path / "pause"
    pause.touch()  # the worker holds its first batch (offset 0) until this goes
    w = workers(pg_dsn, topic, group, env={"KSTORE_MIRROR_OFFSETS": "1", "KSTORE_TEST_PAUSE_FILE": str(pause)})
    wait_until(Path(f"{pause}.batch").exists, 60, what="the worker's first batch")
    # The operator has the workers' settings (the group has mirrored nothing yet: Kafka cannot tell).
    r = offsets_set("--group", group, "--topic", topic, "--to-latest", "--reason", "skip", "--execute", "--dsn", pg_dsn,
                    "--bootstrap-servers", kafka, env={"KSTORE_MIRROR_OFFSETS": "1"})
    assert r.returncode == 0, r.stderr
    assert f"Kafka's committed offsets of '{group}' (mirror_offsets) are left to its live workers" in r.stdout
    pause.unlink()  # the batch in flight is fenced (rolled back); the worker follows the move to 100
    wait_until(lambda: committed_in_kafka(kafka, group) == {(topic, 0): (100, MIRROR_METADATA)}, 30,
               what="the worker to mirror the operator's move")
    assert stored_offsets(pg_dsn, group) == {(topic, 0): 100}
    assert w.terminate() == 0
    assert not effects(pg_dsn), "the skipped messages were processed"
