"""Two operators, each in a Chromium of their own, replay two dead letters at the same moment through one
``kstore console`` (its one processor object for the group) on PostgreSQL: both land, once each, and
each letter's history names who replayed it.

The processor's handler takes its time (:mod:`tests.support.replay_processors`); its log shows the
second click came while the first replay's handler ran, and that the replays ran one after the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from threading import Thread

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.browser import ConsoleProcess, click, log_in, start_browser
from tests.support.harness import wait_until
from tests.support.replay_processors import LOG_ENV, SlowReplay, dead_letter, effect_counts, steps, when

pytestmark = pytest.mark.integration

GROUP = SlowReplay.group


def _replay_in_thread(browser: WebDriver, reason: str) -> tuple[Thread, list[float]]:
    """Click the letter page's replay in a thread of its own (the click waits for the next page);
    the list gets the time the click was made."""
    clicked: list[float] = []
    browser.find_element(By.ID, "reason").send_keys(reason)

    def replay() -> None:
        clicked.append(time.time())
        click(browser, browser.find_element(By.ID, "replay"))

    thread = Thread(target=replay, daemon=True)
    thread.start()
    return thread, clicked


def test_two_operators_in_two_browsers_replay_two_letters_at_once_and_each_lands_once(
        pg_dsn: str, console: Callable[..., ConsoleProcess], browser: WebDriver, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "replays.log"
    monkeypatch.setenv(LOG_ENV, str(log))  # the console process inherits it
    a, b = dead_letter(pg_dsn, {"n": 1, "hold": 2}), dead_letter(pg_dsn, {"n": 2, "hold": 2})
    web = console(pg_dsn, GROUP, "--processor", "replay_processors:SlowReplay")
    bob = start_browser(tmp_path / "bob-chromium-profile")
    try:
        log_in(browser, web.url, "ann")
        log_in(bob, web.url, "bob")
        browser.get(f"{web.url}/groups/{GROUP}/dead-letters/{a}")
        bob.get(f"{web.url}/groups/{GROUP}/dead-letters/{b}")

        ann_clicks, _ = _replay_in_thread(browser, "fixed by ann")
        wait_until(lambda: any(s.what == "start" and s.n == 1 for s in steps(log)), 30,
                   what="Ann's replay in its handler")
        bob_clicks, bob_clicked = _replay_in_thread(bob, "fixed by bob")
        for thread in (ann_clicks, bob_clicks):
            thread.join(60)
            assert not thread.is_alive()

        for who, name, letter in ((browser, "ann", a), (bob, "bob", b)):
            assert who.find_element(By.ID, "flash").text == f"replayed dead letter {letter}", name
            assert who.find_element(By.ID, "status").text == "replayed", name
            history = who.find_element(By.ID, "history").text
            assert f"{name}@" in history and f"fixed by {name}" in history and "dead → replayed" in history
    finally:
        bob.quit()

    assert effect_counts(pg_dsn) == {1: 1, 2: 1}
    found = steps(log)
    assert bob_clicked[0] < when(found, "end", 1) - 1, "Bob clicked while Ann's replay ran"
    assert [(s.what, s.n) for s in found] == [("setup", None), ("start", 1), ("end", 1), ("teardown", None),
                                              ("setup", None), ("start", 2), ("end", 2), ("teardown", None)]
