"""Static membership (``group_instance_id``) is refused: a static member that restarts within
the session timeout gets its old partitions back without a rebalance, so the group's leader
never compares the database it writes to with the group's (one pipeline, one database)."""

from __future__ import annotations

import pytest

from tests.integration.cli.test_cli import assert_one_clear_line, kstore

WHY = "the group's leader never checks which database it writes to"


@pytest.mark.parametrize(("args", "env"), [
    (["--kafka-option", "group_instance_id=pod-1"], {}),
    ([], {"KSTORE_KAFKA_GROUP_INSTANCE_ID": "pod-1"}),
])
def test_the_worker_refuses_a_static_member_id_with_one_line(sqlite_dsn: str, args: list[str],
                                                            env: dict[str, str]) -> None:
    """From a flag or the environment: one line on stderr naming the option and why, exit 2,
    before anything connects (the brokers given here do not exist)."""
    r = kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--bootstrap-servers", "127.0.0.1:1",
               "--topic", "t", *args, env=env)
    assert_one_clear_line(r, "group_instance_id", WHY)


