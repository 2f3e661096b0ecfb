"""A dead letter of a megabyte, as an operator meets it: a real headless Chromium on ``kstore console``
against PostgreSQL. Its page is small and quick, and its small forms discard and replay it.

The browser and the console process: :mod:`tests.support.browser`."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from kstore.db import deadletters
from kstore.db.writes import now
from tests.support.browser import ConsoleProcess, click, log_in
from tests.support.large_letter_processors import digest, large_effects

pytestmark = pytest.mark.integration

GROUP = "large-letters"
SIZE = 1_000_000
#: However large the letter, its page stays under this.
SMALL_PAGE = 64 * 1024
#: A page that takes longer than this is one that renders the whole value.
QUICK_S = 3.0


def _letter(engine: sa.Engine, offset: int, value: bytes) -> int:
    t = deadletters.build_table()
    with engine.begin() as conn:
        return int(conn.execute(t.insert().returning(t.c.id), {
            "consumer_group": GROUP, "topic": "orders", "partition_id": 0, "offset": offset, "key": b"order",
            "value": value, "headers": "[]", "error": "ValueError: too large an order", "traceback": "...",
            "attempts": 1, "first_failure_at": now(), "last_failure_at": now(),
            "status": deadletters.DEAD}).scalar_one())


def _open(browser: WebDriver, url: str) -> float:
    """Open ``url``; how long it took."""
    started = time.monotonic()
    browser.get(url)
    return time.monotonic() - started


def test_an_operator_discards_one_letter_of_a_megabyte_and_replays_another_from_their_pages(
        pg_dsn: str, console: Callable[..., ConsoleProcess], browser: WebDriver) -> None:
    # Not UTF-8 text: the page shows the start of it as base64, and the processor must get every byte.
    value = bytes(range(256)) * (SIZE // 256) + b"\xff" * (SIZE % 256)
    engine = sa.create_engine(pg_dsn)
    discarded, replayed = _letter(engine, 10, value), _letter(engine, 11, value)
    web = console(pg_dsn, GROUP, "--processor", "large_letter_processors:Measured")
    log_in(browser, web.url, "ann")

    took = _open(browser, f"{web.url}/groups/{GROUP}/dead-letters/{discarded}")
    assert took < QUICK_S and len(browser.page_source.encode()) < SMALL_PAGE
    assert browser.find_element(By.ID, "value-size").text.startswith(f"{SIZE:,} bytes; the first 4,096 of ")
    assert "shown as base64" in browser.find_element(By.ID, "value-encoding").text
    browser.find_element(By.ID, "reason").send_keys("an order too large to take")
    click(browser, browser.find_element(By.ID, "discard"))
    assert browser.find_element(By.ID, "flash").text == f"discarded dead letter {discarded}"
    assert browser.find_element(By.ID, "status").text == "discarded"

    took = _open(browser, f"{web.url}/groups/{GROUP}/dead-letters/{replayed}")
    assert took < QUICK_S
    click(browser, browser.find_element(By.ID, "replay"))
    assert browser.find_element(By.ID, "flash").text == f"replayed dead letter {replayed}"
    assert browser.find_element(By.ID, "status").text == "replayed"

    with engine.connect() as conn:
        t = deadletters.build_table()
        statuses = {r.id: r.status for r in conn.execute(sa.select(t.c.id, t.c.status))}
        effects = conn.execute(sa.select(large_effects.c.kafka_offset, large_effects.c.size,
                                         large_effects.c.sha256)).all()
    engine.dispose()
    assert statuses == {discarded: deadletters.DISCARDED, replayed: deadletters.REPLAYED}
    assert [tuple(e) for e in effects] == [(11, SIZE, digest(value))]
