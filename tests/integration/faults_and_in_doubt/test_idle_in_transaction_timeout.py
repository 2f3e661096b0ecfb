"""`idle_in_transaction_session_timeout` on kstore's PostgreSQL connections ends a paused zombie's
transaction: a SIGSTOPped worker inside its batch, holding its partition's offsets row lock, stalls
the new owner's claim only until the server ends the zombie's session; the claim then goes through
while the zombie is still stopped, and every effect lands exactly once."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.harness import assert_exactly_once, effects, wait_until

# The database's promise (its idle-in-transaction timeout), on the default client: a SIGSTOPped
# zombie fenced on each client is test_faults.py's contract test.

#: Longer than the Kafka session timeout of the tests' workers (6 s): the new owner is assigned
#: the partition while the zombie's transaction still holds the row.
ZOMBIE_IDLE_TIMEOUT_MS = 12_000


def writers(dsn: str) -> dict[tuple[str, int, int], str]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT topic, partition_id, kafka_offset, worker FROM effects")).all()
    finally:
        engine.dispose()
    return {(r[0], r[1], r[2]): r[3] for r in rows}


@pytest.mark.long
def test_the_idle_in_transaction_timeout_ends_a_sigstopped_zombies_transaction(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    topic = new_topic(partitions=1)
    sent = set(produce(topic, (f"v{i}" for i in range(10)), partition=0))
    hang = tmp_path / "hang"
    zombie = workers(pg_dsn, topic, f"zombie-lock-{topic}", "promise_processors:LocksItsOffsetRow", env={
        "KSTORE_TEST_HANG_AT": "0", "KSTORE_TEST_HANG_FILE": str(hang),
        "KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": str(ZOMBIE_IDLE_TIMEOUT_MS)})
    wait_until(hang.exists, 180, interval=0.02, what="the zombie inside its batch, holding the row")
    zombie.pause()
    try:
        owner = workers(pg_dsn, topic, f"zombie-lock-{topic}", "promise_processors:LocksItsOffsetRow",
                        env={"KSTORE_CLAIM_LOCK_TIMEOUT_MS": "2000"})
        owner.wait_for_log(r"assigned \S+; claiming before any delivery", timeout=120)
        owner.wait_for_log(r"claimed \S+\[0\]@0", timeout=60)
        # The claim waited for the zombie's row lock, and got it while the zombie was still stopped.
        assert re.search(r"could not claim .*lock timeout", owner.log), owner.log[-3000:]
        assert zombie.proc.poll() is None
        wait_until(lambda: len(effects(pg_dsn)) >= 10, 60, what="the new owner's 10 effects")
        assert_exactly_once(effects(pg_dsn), sent)
    finally:
        zombie.resume()
    assert owner.terminate() == 0
    zombie.terminate()  # it wakes to a session the server ended: nothing of its batch may land
    assert_exactly_once(effects(pg_dsn), sent)
    assert set(writers(pg_dsn).values()) == {"w2"}
