"""The ``peer`` fixture: every contract test runs once on each peer behind kstore's seam, the
in-memory stub and the two real clients (see :mod:`tests.contract.peers`).

The real peers' runs are marked ``integration`` and ``contract``: they need the harness's broker,
and they belong with the other promises of the seam (run on both clients in CI's first pass, left
out of the passes that run one client's tests again). The stub's run needs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .peers import Peer, RealPeer, StubPeer

PEERS = [
    pytest.param("stub", id="stub"),
    *(pytest.param(client, id=client, marks=[pytest.mark.integration, pytest.mark.contract])
      for client in ("confluent", "kafka-python")),
]


@pytest.fixture(params=PEERS)
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    made: Peer
    if request.param == "stub":
        made = StubPeer()
    else:
        made = RealPeer(request.param, request.getfixturevalue("kafka"), request.getfixturevalue("admin"),
                        request.getfixturevalue("producer"), request.getfixturevalue("new_topic"))
    try:
        yield made
    finally:
        made.close()
