"""One Kafka group runs one rebalance protocol: a worker that joins a group whose members run another
(workers of the same pipeline left on kafka-python's eager protocol while new ones start on
confluent-kafka's cooperative default) is told so in one line and stops, having claimed nothing."""

from __future__ import annotations

from typing import Any

from tests.support.harness import assert_exactly_once, effects, wait_until


def test_a_worker_on_another_protocol_than_its_groups_stops_with_one_line(pg_dsn: str, new_topic: Any, produce: Any,
                                                                       workers: Any) -> None:
    topic = new_topic(2)
    group = f"protocols-{topic}"
    sent = set(produce(topic, [f"a{i}" for i in range(10)]))
    old = workers(pg_dsn, topic, group, env={"KSTORE_KAFKA_CLIENT": "kafka-python"})
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="the eager worker's messages")
    new = workers(pg_dsn, topic, group, env={"KSTORE_KAFKA_CLIENT": "confluent",
                                             "KSTORE_REBALANCE_PROTOCOL": "cooperative"})
    assert new.proc.wait(timeout=60) == 2, new.log
    last = new.log.strip().splitlines()[-1]
    assert last.startswith(f"kstore: error: group {group!r} has members on another rebalance protocol than this "
                           "worker's (cooperative, kafka_client confluent)"), new.log
    assert "Traceback" not in new.log and "claimed " not in new.log
    # The group's own workers go on as if nothing happened.
    sent |= set(produce(topic, [f"b{i}" for i in range(10)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(sent), 60, what="the later messages")
    assert old.proc.poll() is None and old.terminate() == 0
    assert_exactly_once(effects(pg_dsn), sent)
