"""A relay takes the shards of a relay whose worker left the Kafka group at once, not when their
lease runs out: on SQLite with real leases, the group described by a scripted reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from kstore import Settings, migrate
from kstore.kafka.seam import GroupMember, GroupView
from kstore.relay import departures as relay_module
from kstore.relay.loop import Relay

LEASE_S = 300.0


class ScriptedGroup:
    """Describes the group as scripted, one view per call; the last one from then on."""

    def __init__(self, *views: GroupView) -> None:
        self.views = list(views)
        self.asked = 0

    def group_view(self, group: str) -> GroupView:
        self.asked += 1
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


def view(*client_ids: str, settled: bool) -> GroupView:
    return GroupView(tuple(GroupMember(f"m-{c}", c) for c in client_ids), settled)


@pytest.fixture
def relay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Relay:
    dsn = f"sqlite:///{tmp_path / 'k.db'}"
    settings = Settings(dsn=dsn, bootstrap_servers="127.0.0.1:9", group="shop")
    migrate(settings)
    monkeypatch.setattr(relay_module, "SETTLE_RECHECK_S", 0.0)
    r = Relay(settings, "shop", sa.create_engine(dsn), member="w2")
    r.outbox.ensure_shards(3)
    # w1 (a worker's relay) holds shard 0, a standalone relay (never in the group) shard 1.
    assert r.outbox.claim("w1", 0, LEASE_S) is not None
    assert r.outbox.claim("standalone", 1, LEASE_S) is not None
    return r


def free(r: Relay) -> set[int]:
    """The lanes no live lease holds."""
    return set(r.outbox.free_lanes())


def describe(r: Relay, reader: ScriptedGroup) -> None:
    r._admin = reader  # type: ignore[assignment]
    r._free_departed()


def test_a_worker_gone_between_two_settled_views_loses_its_shards_at_once(relay: Relay) -> None:
    describe(relay, ScriptedGroup(view("w1", "w2", settled=True)))
    assert free(relay) == {2}  # both still leased: nobody left yet
    describe(relay, ScriptedGroup(view("w2", settled=True)))
    assert free(relay) == {0, 2}  # w1's shard is free now; the standalone relay's is not


def test_a_worker_killed_while_the_group_rebalanced_loses_its_shards_once_it_settles(relay: Relay) -> None:
    """This relay's first look at the group finds it rebalancing with w1 still listed; w1 is killed
    before it settles, so no settled view ever shows it. It is gone all the same."""
    reader = ScriptedGroup(view("w1", "w2", settled=False), view("w2", settled=False), view("w2", settled=True))
    describe(relay, reader)
    assert reader.asked == 3
    assert free(relay) == {0, 2}


def test_members_seen_while_the_group_never_settled_are_remembered_for_the_next_look(
        relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "SETTLE_PATIENCE_S", 0.0)
    describe(relay, ScriptedGroup(view("w1", "w2", settled=False)))
    assert free(relay) == {2}  # no settled view: nothing decided
    describe(relay, ScriptedGroup(view("w2", settled=True)))
    assert free(relay) == {0, 2}


def test_a_relay_never_in_the_group_keeps_its_lease(relay: Relay) -> None:
    describe(relay, ScriptedGroup(view("w2", settled=False), view("w2", settled=True)))
    assert free(relay) == {2}
