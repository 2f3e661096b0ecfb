"""The operator's commands right after a broker starts, when it answers "not now" (its group
coordinator not available yet): they ask again within ``connect_timeout_s``, and past it say so
in one line with exit 2, never "unexpected error"."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import CoordinatorNotAvailableError

from kstore import Settings
from kstore.cli import main
from kstore.ops.offsets import set_offsets, show_offsets
from kstore_devbroker.broker import Cluster
from tests.conftest import BROKER_CONFIG, KAFKA_CLIENT, _has_leaders
from tests.support.harness import wait_until


def test_offsets_set_and_show_right_after_a_broker_started_ask_again(pg_dsn: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A broker started a moment ago has no offsets topic yet: its first answer to "who
    coordinates this group?" is COORDINATOR_NOT_AVAILABLE (it creates the topic then). The first
    command to ask it (`offsets set --execute`, looking for a mirror of the group's offsets)
    asks again; `offsets show` then finds the coordinator."""
    with Cluster(1, extra_config=BROKER_CONFIG) as fresh:
        admin = KafkaAdminClient(bootstrap_servers=fresh.bootstrap_servers)
        try:
            admin.create_topics([NewTopic("fresh", num_partitions=2, replication_factor=1)])
            wait_until(lambda: _has_leaders(admin, "fresh", 2), 30, what="the topic's leaders")
        finally:
            admin.close()
        settings = Settings(dsn=pg_dsn, bootstrap_servers=fresh.bootstrap_servers, kafka_client=KAFKA_CLIENT)
        with caplog.at_level(logging.DEBUG, logger="kstore.kafka.asking"):
            moved = set_offsets(settings, "early", "fresh", to_earliest=True, execute=True, reason="test")
            shown = show_offsets(settings, "early")
    assert [(p.partition, p.to_offset, p.mirror) for p in moved] == [(0, 0, ""), (1, 0, "")]
    assert [(s.partition, s.next_offset, s.owner) for s in shown] == [(0, 0, None), (1, 0, None)]
    if KAFKA_CLIENT == "kafka-python":  # librdkafka waits for the coordinator itself, within the request
        assert ("cannot read the committed offsets of group 'early' yet (COORDINATOR_NOT_AVAILABLE): asking again"
                in caplog.text), caplog.text


def test_a_coordinator_that_stays_unavailable_is_one_line_and_exit_2(pg_dsn: str, kafka: str, new_topic: Any,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    topic = new_topic(partitions=1)
    set_offsets(Settings(dsn=pg_dsn, bootstrap_servers=kafka), "stuck", topic, to_earliest=True, execute=True,
                reason="test")
    asked: list[list[str]] = []

    def unavailable(_admin: Any, group_ids: list[str], *_args: Any, **_kwargs: Any) -> Any:
        asked.append(group_ids)
        raise CoordinatorNotAvailableError("FindCoordinatorResponse error for GROUP/stuck: ")

    monkeypatch.setattr(KafkaAdminClient, "describe_groups", unavailable)
    monkeypatch.setenv("KSTORE_KAFKA_CLIENT", "kafka-python")  # the client whose answer is made up here
    monkeypatch.setenv("KSTORE_CONNECT_TIMEOUT_S", "1")
    with pytest.raises(SystemExit) as exited:
        main(["offsets", "show", "--group", "stuck", "--dsn", pg_dsn, "--bootstrap-servers", kafka])
    assert exited.value.code == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        f"kstore: error: Kafka at {kafka} could not describe group 'stuck' within 1s (connect_timeout_s): "
        "still COORDINATOR_NOT_AVAILABLE"], out.err
    assert out.out == ""
    assert len(asked) >= 3, f"asked {len(asked)} time(s) within the second"
