"""The web console as a person uses it: a real headless Chromium (Debian's, through its chromedriver)
on ``kstore console`` against real Kafka and PostgreSQL, with a worker running.

No browser is downloaded: Selenium is given /usr/bin/chromium and /usr/bin/chromedriver, which
scripts/setup installs. Without them these tests fail; they never skip.
Set KSTORE_TEST_SCREENSHOTS=DIR to keep a screenshot of each page there (docs/ takes them).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from kstore import Settings
from kstore.db import deadletters
from kstore.ops.offsets import set_offsets
from tests.support.harness import REPO_DIR, SUPPORT_DIR, WorkerProcess, effects, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
PASSWORD = "console-test-Pw"
#: How the browser runs on these machines (no GPU, no sandbox as root, nothing fetched in the background).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ConsoleProcess:
    """``kstore console`` in a subprocess, with the test processors importable (to replay)."""

    def __init__(self, tmp_path: Path, dsn: str, kafka: str, group: str, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        password_file = tmp_path / "console-password"
        password_file.write_text(PASSWORD + "\n")
        self.log_path = tmp_path / "console.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kstore", "console", "--dsn", dsn, "--bootstrap-servers", kafka,
             "--port", str(self.port), "--password-file", str(password_file), "--sample-interval", "1", *args],
            cwd=SUPPORT_DIR, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "KSTORE_GROUP": group,
                 "PYTHONPATH": os.pathsep.join([str(SUPPORT_DIR), str(REPO_DIR)])})
        wait_until(self._up, 60, what=f"the console at {self.url}\n{self.log_path.read_text()}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the console exited ({self.proc.returncode}):\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/login", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


@pytest.fixture
def console(tmp_path: Path, kafka: str) -> Iterator[Callable[..., ConsoleProcess]]:
    started: list[ConsoleProcess] = []

    def start(dsn: str, group: str, *args: str) -> ConsoleProcess:
        started.append(ConsoleProcess(tmp_path, dsn, kafka, group, *args))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


def _shot(browser: WebDriver, name: str) -> None:
    folder = os.environ.get("KSTORE_TEST_SCREENSHOTS")
    if folder:
        browser.save_screenshot(str(Path(folder) / f"console-{name}.png"))


def _log_in(browser: WebDriver, url: str, name: str) -> None:
    browser.get(url + "/")
    assert "/login" in browser.current_url  # every page wants a login first
    browser.find_element(By.NAME, "operator").send_keys(name)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    _click(browser, browser.find_element(By.CSS_SELECTOR, "#login button"))
    assert browser.find_element(By.ID, "operator").text == name


def _click(browser: WebDriver, element: WebElement) -> None:
    """Click what submits a form or follows a link, and wait for the next page: a click returns
    before the browser has left the page it was on."""
    page = browser.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(browser, 30).until(expected_conditions.staleness_of(page))
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")


def _text(browser: WebDriver) -> str:
    text: str = browser.find_element(By.TAG_NAME, "body").text
    return text


def _effect_values(dsn: str) -> list[str]:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        values = list(conn.execute(sa.text("SELECT value FROM effects ORDER BY kafka_offset")).scalars())
    engine.dispose()
    return values


def _statuses(dsn: str) -> dict[int, str]:
    engine = sa.create_engine(dsn)
    t = deadletters.build_table()
    with engine.connect() as conn:
        found = {r.id: r.status for r in conn.execute(sa.select(t.c.id, t.c.status))}
    engine.dispose()
    return found


def _orders(n: int, crashes: set[int]) -> list[str]:
    return [json.dumps({"n": i, **({"kind": "crash"} if i in crashes else {})}) for i in range(n)]


def test_an_operator_watches_a_running_worker_and_replays_an_edited_dead_letter(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
        workers: Callable[..., WorkerProcess], console: Callable[..., ConsoleProcess], browser: WebDriver) -> None:
    topic, group = new_topic(partitions=2), "console-replay"
    produce(topic, _orders(20, crashes={3, 7, 11}), partition=0)
    produce(topic, _orders(10, crashes=set()), partition=1)
    worker = workers(pg_dsn, topic, group, processor="letter_processors:Lettered")
    wait_until(lambda: len(_statuses(pg_dsn)) == 3 and len(_effect_values(pg_dsn)) == 27, 120,
               what="27 effects and 3 dead letters")
    web = console(pg_dsn, group, "--processor", "letter_processors:Lettered")
    _log_in(browser, web.url, "ann")

    # The overview: every partition, caught up, held by the running worker; the charts fill as samples come.
    browser.get(f"{web.url}/groups/{group}")
    rows = browser.find_elements(By.CSS_SELECTOR, "#partitions tr")[1:]
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == ["0", "1"]
    assert [r.find_element(By.CSS_SELECTOR, "td.lag").text for r in rows] == ["0", "0"]
    owner = worker.name
    assert all(owner in r.text for r in rows)
    assert browser.find_element(By.ID, "dead-letters").text == "3"
    assert owner in browser.find_element(By.ID, "workers").text

    def charted() -> bool:
        browser.refresh()
        return "lag (messages): now 0.0" in _text(browser)

    wait_until(charted, 30, interval=1, what="the lag chart")
    assert browser.find_elements(By.CSS_SELECTOR, "figure.chart svg polyline")
    _shot(browser, "overview")

    # Filter the dead letters: the three orders that crashed, by their error's type and text.
    browser.get(f"{web.url}/groups/{group}/dead-letters")
    browser.find_element(By.NAME, "error_type").send_keys("RuntimeError")
    browser.find_element(By.NAME, "error").send_keys("order 7")
    _click(browser, browser.find_element(By.CSS_SELECTOR, "#filter button"))
    listed = browser.find_elements(By.CSS_SELECTOR, "#letters tr.letter")
    assert len(listed) == 1 and "the handler broke on order 7" in listed[0].text
    _shot(browser, "dead-letters")
    _click(browser, listed[0].find_element(By.TAG_NAME, "a"))
    letter_id = int(browser.find_element(By.ID, "letter-id").text)
    assert json.loads(browser.find_element(By.ID, "value").text) == {"n": 7, "kind": "crash"}

    # Replay it with the value edited (the crash marker taken out): the processor writes its effect.
    browser.find_element(By.ID, "edit").click()
    box = browser.find_element(By.ID, "edited-value")
    box.clear()
    box.send_keys('{"n": 1007}')
    # Enter in the reason field acts on nothing (the form's default button is disabled): every action
    # is a click on its own button. (Had it submitted, the replay below would find no form.)
    assert browser.execute_script("return document.querySelector('#act button[type=submit]').disabled")
    browser.find_element(By.ID, "reason").send_keys("order 7 fixed by hand" + Keys.ENTER)
    assert browser.find_element(By.ID, "status").text == "dead"
    assert _statuses(pg_dsn)[letter_id] == "dead"
    _shot(browser, "dead-letter")
    _click(browser, browser.find_element(By.ID, "replay"))
    assert browser.find_element(By.ID, "flash").text == f"replayed dead letter {letter_id} with the edited value"
    assert browser.find_element(By.ID, "status").text == "replayed"
    history = browser.find_element(By.ID, "history").text
    assert "ann@" in history and "order 7 fixed by hand" in history and "dead → replayed" in history
    assert "1007" in _effect_values(pg_dsn)
    assert _statuses(pg_dsn)[letter_id] == deadletters.REPLAYED
    assert sorted(s for i, s in _statuses(pg_dsn).items() if i != letter_id) == ["dead", "dead"]


def test_an_operator_sees_a_groups_lag_fall_on_the_chart_as_its_worker_drains_the_backlog(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
        workers: Callable[..., WorkerProcess], console: Callable[..., ConsoleProcess], browser: WebDriver) -> None:
    topic, group = new_topic(partitions=2), "console-lag-falls"
    for partition in (0, 1):
        produce(topic, [f"order {n}" for n in range(1500)], partition=partition)
    # The group's offsets stored at the start and no worker yet: 3,000 messages behind.
    set_offsets(Settings(dsn=pg_dsn, bootstrap_servers=kafka), group, topic, to_earliest=True, execute=True,
                reason="a backlog to drain")
    web = console(pg_dsn, group)
    _log_in(browser, web.url, "ann")
    browser.get(f"{web.url}/groups/{group}")

    def caption(title: str) -> str:
        browser.refresh()
        return next((c.text for c in browser.find_elements(By.CSS_SELECTOR, "figure.chart figcaption")
                     if c.text.startswith(title)), "")

    wait_until(lambda: caption("lag (messages)").startswith("lag (messages): now 3,000.0 messages"), 30,
               interval=1, what="two samples of the backlog on the lag chart")
    workers(pg_dsn, topic, group)
    wait_until(lambda: caption("lag (messages)").startswith("lag (messages): now 0.0 messages, most 3,000.0"), 90,
               interval=1, what="the lag chart falling to 0")
    # The line itself comes down: SVG's y grows downwards, so the last point sits below the first.
    points = browser.find_element(By.CSS_SELECTOR, "figure.chart svg polyline").get_attribute("points") or ""
    ys = [float(xy.split(",")[1]) for xy in points.split()]
    assert ys[-1] > ys[0], points
    throughput = caption("throughput (messages/s)")
    assert throughput.startswith("throughput (messages/s): now ") and ", most 0.0 " not in throughput, throughput
    assert browser.find_element(By.CSS_SELECTOR, "#partitions td.lag").text == "0"
    assert len(_effect_values(pg_dsn)) == 3000
    _shot(browser, "lag-falls")
    # On demand, one partition's own chart: its 1,500 behind, then none.
    _click(browser, browser.find_element(By.CSS_SELECTOR, "#partitions a.partition"))
    assert browser.find_element(By.ID, "partition-title").text == f"{topic}[0]"
    assert caption("lag (messages)").startswith("lag (messages): now 0.0 messages, most 1,500.0")
    _shot(browser, "partition")


def test_an_operator_plans_and_executes_a_reset_that_the_running_worker_follows(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
        workers: Callable[..., WorkerProcess], console: Callable[..., ConsoleProcess], browser: WebDriver) -> None:
    topic, group = new_topic(partitions=2), "console-reset"
    produce(topic, [f"a{i}" for i in range(10)], partition=0)
    produce(topic, [f"b{i}" for i in range(10)], partition=1)
    workers(pg_dsn, topic, group)  # processors:Recorder: one effect row per message
    wait_until(lambda: sum(effects(pg_dsn).values()) == 20, 120, what="20 effects")
    web = console(pg_dsn, group)
    _log_in(browser, web.url, "bob")

    browser.get(f"{web.url}/groups/{group}/offsets")
    Select(browser.find_element(By.ID, "topic")).select_by_visible_text(topic)
    browser.find_element(By.ID, "partitions").send_keys("0")
    Select(browser.find_element(By.ID, "target")).select_by_value("offset")
    browser.find_element(By.ID, "target-value").send_keys("6")
    _click(browser, browser.find_element(By.ID, "plan"))
    plan = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#plan tr")[1:]]
    assert plan == [f"{topic}[0] 10 6"], _text(browser)
    assert sum(effects(pg_dsn).values()) == 20  # a plan moves nothing
    _shot(browser, "reset-plan")
    browser.find_element(By.ID, "reason").send_keys("replay the last four")
    _click(browser, browser.find_element(By.ID, "execute"))
    assert browser.find_element(By.ID, "flash").text.startswith(f"reset applied: {topic}[0] 10 -> 6")
    newest = browser.find_elements(By.CSS_SELECTOR, "#history tr")[1].text
    assert "bob@" in newest and "kstore console: replay the last four" in newest
    _shot(browser, "offsets")

    # The running worker follows the move: offsets 6..9 of partition 0 are processed once more, nothing else.
    wait_until(lambda: sum(effects(pg_dsn).values()) == 24, 60, what="the worker replaying offsets 6..9")
    counts = effects(pg_dsn)
    assert {k: v for k, v in counts.items() if v == 2} == {(topic, 0, o): 2 for o in range(6, 10)}


def test_every_action_is_refused_without_a_login_or_with_a_bad_csrf_token(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
        workers: Callable[..., WorkerProcess], console: Callable[..., ConsoleProcess], browser: WebDriver) -> None:
    topic, group = new_topic(partitions=1), "console-refusals"
    produce(topic, _orders(4, crashes={1}), partition=0)
    workers(pg_dsn, topic, group, processor="letter_processors:Lettered")
    wait_until(lambda: len(_statuses(pg_dsn)) == 1, 120, what="a dead letter")
    [letter_id] = _statuses(pg_dsn)
    web = console(pg_dsn, group, "--processor", "letter_processors:Lettered")
    actions = [f"/groups/{group}/dead-letters/{letter_id}/{a}" for a in ("replay", "discard", "resolve")] + [
        f"/groups/{group}/dead-letters/matching/{a}" for a in ("replay", "discard", "resolve")] + [
        f"/groups/{group}/offsets/plan", f"/groups/{group}/offsets/execute", "/logout"]

    def post(path: str, token: str | None) -> str:
        """Submit a form to ``path`` from the console's own page, as a forged or stale page would."""
        page = browser.find_element(By.TAG_NAME, "html")
        browser.execute_script(
            "const f = document.createElement('form'); f.method = 'post'; f.action = arguments[0];"
            "for (const [k, v] of Object.entries(arguments[1])) { const i = document.createElement('input');"
            " i.name = k; i.value = v; f.appendChild(i); } document.body.appendChild(f); f.submit();",
            path, {"reason": "no", "topic": topic, "target": "earliest", "partitions": "0",
                   **({"csrf_token": token} if token is not None else {})})
        WebDriverWait(browser, 30).until(expected_conditions.staleness_of(page))
        wait_until(lambda: browser.find_elements(By.ID, "refused"), 10, what=f"the answer to {path}")
        return _text(browser)

    browser.get(f"{web.url}/login")  # not logged in
    for path in actions[:-1]:
        assert "log in first" in post(path, None), path
    _log_in(browser, web.url, "eve")
    for path in actions:
        for token in ("forged", ""):
            browser.get(f"{web.url}/groups/{group}/dead-letters/{letter_id}")
            assert "CSRF token mismatch" in post(path, token), path
    assert _statuses(pg_dsn) == {letter_id: deadletters.DEAD}
    engine = sa.create_engine(pg_dsn)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM kstore_offset_history WHERE reason LIKE 'kstore console%'")
                            ).scalar_one() == 0
    engine.dispose()
