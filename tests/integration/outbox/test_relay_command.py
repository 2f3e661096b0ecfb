"""``kstore relay`` on its own, as an operator runs it: it says on stderr when a stop signal reaches
it, as ``kstore worker`` does, and exits 0 after the records it took are published; librdkafka says
nothing at WARNING on its start, a transactional producer's first on this broker included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from kstore import Settings
from kstore.outbox import Outbox
from tests.support.harness import SUPPORT_DIR, outbox_rows, read_committed, wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_the_relay_logs_its_stop_and_exits_0(signum: signal.Signals, sqlite_dsn: str, kafka: str, new_topic: Any,
                                             tmp_path: Path) -> None:
    topic = new_topic(partitions=1)
    engine = sa.create_engine(sqlite_dsn)
    events = Outbox("relay-stop", Settings(dsn=sqlite_dsn), shards=1)
    events.setup(engine)
    with Session(engine) as session, session.begin():
        events.produce(session, topic, "placed", key="c-1")
    engine.dispose()
    err = tmp_path / "stderr.log"
    with err.open("wb") as stderr:
        relay = subprocess.Popen([sys.executable, "-m", "kstore", "relay", "--outbox", "relay-stop", "--dsn",
                                  sqlite_dsn, "--bootstrap-servers", kafka], cwd=SUPPORT_DIR, stdout=subprocess.PIPE,
                                 stderr=stderr, env={**os.environ, "PYTHONPATH": str(SUPPORT_DIR)})
    try:
        wait_until(lambda: read_committed(kafka, topic, 1), 60, what=f"the record on {topic}")
        wait_until(lambda: outbox_rows(sqlite_dsn) == 0, 30, what="the outbox drained")
        relay.send_signal(signum)
        code = relay.wait(60)
    finally:
        if relay.poll() is None:
            relay.kill()
    out, log = relay.stdout.read().decode() if relay.stdout else "", err.read_text()
    assert code == 0, log
    stops = [line.split(" ", 2)[2] for line in log.splitlines() if " received: " in line]  # past the time
    assert stops == [f"INFO kstore.cli: {signum.name} received: finishing the transactions in flight, then giving "
                     "the outbox's shards up"], log
    assert " received: " not in out
    # librdkafka's lines: a transactional producer's first start on a broker meets a coordinator still
    # loading, which it retries by itself (tests/unit/kafka/test_librdkafka_log_levels.py).
    assert not [line for line in log.splitlines() if " WARNING kstore.kafka." in line], log
