"""A ``text()`` INSERT ending with a ``-- note`` comment, through ``kstore worker`` on both drivers.

On psycopg2, kstore's engine used to send the rows of such a statement with psycopg2's
``execute_batch``, which joins a page of statements with ``;`` on one line: the first ``--``
swallowed the rest of its page, and 2 of 900 rows were written while the offsets moved to 900.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support.harness import assert_exactly_once, effects, stored_offsets, wait_until, with_driver


@pytest.mark.timeout(180)
@pytest.mark.parametrize("many", [False, True], ids=["one row per message", "executemany"])
@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_every_row_of_a_commented_insert_lands_once(
        pg_dsn: str, new_topic: Callable[..., str], produce: Any, workers: Any, driver: str, many: bool) -> None:
    dsn = with_driver(pg_dsn, driver)
    topic = new_topic(partitions=1)
    sent = set(produce(topic, (f"v{i}" for i in range(900))))
    w = workers(dsn, topic, "noted", processor="processors:NotedInserts",
                env={"KSTORE_TEST_MANY": "1" if many else "0"}, args=["--max-batch-size", "900"])
    wait_until(lambda: stored_offsets(dsn, "noted").get((topic, 0)) == 900, 90, what="offsets at 900")
    assert w.terminate() == 0
    assert_exactly_once(effects(dsn), sent)
