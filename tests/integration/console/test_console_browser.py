"""The web console as a person uses it: a real headless Chromium (Debian's, through its chromedriver)
on ``kstore console`` against real Kafka and PostgreSQL, with a worker running.

The browser and the console process: :mod:`tests.support.browser` (set KSTORE_TEST_SCREENSHOTS=DIR
to keep a screenshot of each page there; docs/ takes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from kstore import Settings
from kstore.db import deadletters
from kstore.ops.offsets import set_offsets
from tests.support.browser import ConsoleProcess, click, log_in, page_text, shot
from tests.support.harness import WorkerProcess, effects, wait_until


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
    log_in(browser, web.url, "ann")

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
        return "lag (messages): now 0.0" in page_text(browser)

    wait_until(charted, 30, interval=1, what="the lag chart")
    assert browser.find_elements(By.CSS_SELECTOR, "figure.chart svg polyline")
    shot(browser, "overview")

    # Filter the dead letters: the three orders that crashed, by their error's type and text.
    browser.get(f"{web.url}/groups/{group}/dead-letters")
    browser.find_element(By.NAME, "error_type").send_keys("RuntimeError")
    browser.find_element(By.NAME, "error").send_keys("order 7")
    click(browser, browser.find_element(By.CSS_SELECTOR, "#filter button"))
    listed = browser.find_elements(By.CSS_SELECTOR, "#letters tr.letter")
    assert len(listed) == 1 and "the handler broke on order 7" in listed[0].text
    shot(browser, "dead-letters")
    click(browser, listed[0].find_element(By.TAG_NAME, "a"))
    letter_id = int(browser.find_element(By.ID, "letter-id").text)
    assert json.loads(browser.find_element(By.ID, "value").text) == {"n": 7, "kind": "crash"}
    shot(browser, "dead-letter")

    # Replay it with the value edited (the crash marker taken out): the processor writes its effect.
    # The edit is a page of its own, the whole value in its box.
    click(browser, browser.find_element(By.ID, "edit"))
    box = browser.find_element(By.ID, "edited-value")
    box.clear()
    box.send_keys('{"n": 1007}')
    # Enter in the reason field acts on nothing (the form's default button is disabled): every action
    # is a click on its own button. (Had it submitted, the replay below would find no form.)
    assert browser.execute_script("return document.querySelector('#act button[type=submit]').disabled")
    browser.find_element(By.ID, "reason").send_keys("order 7 fixed by hand" + Keys.ENTER)
    assert browser.find_element(By.ID, "status").text == "dead"
    assert _statuses(pg_dsn)[letter_id] == "dead"
    click(browser, browser.find_element(By.ID, "replay"))
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
    log_in(browser, web.url, "ann")
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
    shot(browser, "lag-falls")
    # On demand, one partition's own chart: its 1,500 behind, then none.
    click(browser, browser.find_element(By.CSS_SELECTOR, "#partitions a.partition"))
    assert browser.find_element(By.ID, "partition-title").text == f"{topic}[0]"
    assert caption("lag (messages)").startswith("lag (messages): now 0.0 messages, most 1,500.0")
    shot(browser, "partition")


def test_an_operator_plans_and_executes_a_reset_that_the_running_worker_follows(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], produce: Callable[..., Any],
        workers: Callable[..., WorkerProcess], console: Callable[..., ConsoleProcess], browser: WebDriver) -> None:
    topic, group = new_topic(partitions=2), "console-reset"
    produce(topic, [f"a{i}" for i in range(10)], partition=0)
    produce(topic, [f"b{i}" for i in range(10)], partition=1)
    workers(pg_dsn, topic, group)  # processors:Recorder: one effect row per message
    wait_until(lambda: sum(effects(pg_dsn).values()) == 20, 120, what="20 effects")
    web = console(pg_dsn, group)
    log_in(browser, web.url, "bob")

    browser.get(f"{web.url}/groups/{group}/offsets")
    Select(browser.find_element(By.ID, "topic")).select_by_visible_text(topic)
    browser.find_element(By.ID, "partitions").send_keys("0")
    Select(browser.find_element(By.ID, "target")).select_by_value("offset")
    browser.find_element(By.ID, "target-value").send_keys("6")
    click(browser, browser.find_element(By.ID, "plan"))
    plan = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#plan tr")[1:]]
    assert plan == [f"{topic}[0] 10 6"], page_text(browser)
    assert sum(effects(pg_dsn).values()) == 20  # a plan moves nothing
    shot(browser, "reset-plan")
    browser.find_element(By.ID, "reason").send_keys("replay the last four")
    click(browser, browser.find_element(By.ID, "execute"))
    assert browser.find_element(By.ID, "flash").text.startswith(f"reset applied: {topic}[0] 10 -> 6")
    newest = browser.find_elements(By.CSS_SELECTOR, "#history tr")[1].text
    assert "bob@" in newest and "kstore console: replay the last four" in newest
    shot(browser, "offsets")

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
        return page_text(browser)

    browser.get(f"{web.url}/login")  # not logged in
    for path in actions[:-1]:
        assert "log in first" in post(path, None), path
    log_in(browser, web.url, "eve")
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


#: Group ids Kafka allows that break a link or a path: separators, a query, a fragment, an escape, dots, markup.
HOSTILE_GROUPS = ["team/orders", "q?x=1&y=2", "a#b", "50%off", "..", "<img src=x onerror=alert(1)>", "zürich 2"]


def test_an_operator_reaches_and_acts_on_groups_whose_names_break_urls_and_markup(
        pg_dsn: str, kafka: str, new_topic: Callable[..., str], console: Callable[..., ConsoleProcess],
        browser: WebDriver) -> None:
    topic = new_topic(partitions=1)
    engine = sa.create_engine(pg_dsn)
    letters = deadletters.build_table()
    with engine.begin() as conn:
        for group in HOSTILE_GROUPS:
            conn.execute(sa.text("INSERT INTO kstore_offsets (consumer_group, topic, partition_id, next_offset, epoch, "
                                 "updated_at) VALUES (:g, :t, 0, 0, 1, now())"), {"g": group, "t": topic})
            conn.execute(letters.insert().values(
                consumer_group=group, topic=topic, partition_id=0, offset=2, key=None, value=b"{}", headers="[]",
                error="ValueError: bad", traceback="...", attempts=1, first_failure_at=sa.func.now(),
                last_failure_at=sa.func.now(), status=deadletters.DEAD))
    engine.dispose()
    web = console(pg_dsn, "any")
    log_in(browser, web.url, "ann")

    for group in HOSTILE_GROUPS:
        browser.get(web.url + "/")
        [link] = [a for a in browser.find_elements(By.CSS_SELECTOR, "#groups a") if a.text == group]
        click(browser, link)
        assert browser.title == f"{group}: kstore console", browser.current_url
        assert topic in browser.find_element(By.ID, "partitions").text
        click(browser, browser.find_element(By.LINK_TEXT, "dead letters"))
        click(browser, browser.find_element(By.CSS_SELECTOR, "#letters tr.letter a"))
        browser.find_element(By.ID, "reason").send_keys("a group of an awkward name")
        click(browser, browser.find_element(By.ID, "discard"))
        assert browser.find_element(By.ID, "status").text == "discarded", group
        assert browser.execute_script("return document.images.length") == 0  # the markup stayed text

    assert set(_statuses(pg_dsn).values()) == {deadletters.DISCARDED} and len(_statuses(pg_dsn)) == len(HOSTILE_GROUPS)
