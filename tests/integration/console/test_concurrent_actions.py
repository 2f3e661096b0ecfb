"""Operators acting on dead letters at the same moment through one console, on PostgreSQL: each action
lands exactly once.

The console keeps one processor object per group; replays through it run one at a time (each between
its own ``setup`` and ``teardown``), so one operator's writes never land in another's transaction. Each
operator logs in on a test client of their own, and their requests are sent from threads at once; the
processor's handler takes its time (:mod:`tests.support.replay_processors`), and its log shows the
second request was sent while the first one's handler ran.
"""

from __future__ import annotations

import html
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from kstore import Settings
from kstore.console import app
from kstore.db.deadletters import Change, DeadLetter, show_dead_letter
from kstore.ops import replay as replays
from tests.support.harness import wait_until
from tests.support.replay_processors import LOG_ENV, SlowReplay, dead_letter, effect_counts, steps, when

pytestmark = pytest.mark.integration

GROUP = SlowReplay.group
PASSWORD = "c0nsole-Pa55"
#: What an action on a letter another operator's replay (or change) holds says.
BUSY = "another operator is replaying or changing it right now"


class Acted(NamedTuple):
    sent_at: float
    said: str  # the outcome the page shows


class Operator:
    """One operator in a browser of their own: a test client, logged in."""

    def __init__(self, client: TestClient, name: str) -> None:
        self.client, self.name = client, name
        login = client.get("/login").text
        client.post("/login", data={"csrf_token": _csrf(login), "operator": name, "password": PASSWORD})
        page = client.get(f"/groups/{GROUP}/dead-letters")
        assert page.status_code == 200 and "/login" not in page.url.path, page.text
        self.token = _csrf(page.text)

    def act(self, path: str, **form: str) -> Acted:
        sent_at = time.time()
        page = self.client.post(path, data={"csrf_token": self.token, **form}).text
        said = re.search(r'id="flash">(.*?)</p>', page, re.S)
        return Acted(sent_at, html.unescape(said.group(1)) if said else page)


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


@pytest.fixture
def replay_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "replays.log"
    monkeypatch.setenv(LOG_ENV, str(path))
    return path


@pytest.fixture
def web(pg_dsn: str) -> Starlette:
    settings = Settings(dsn=pg_dsn, bootstrap_servers="127.0.0.1:1", console_password=PASSWORD,
                        console_sample_interval_s=0)
    return app(settings, {GROUP: SlowReplay()}, sample=False)


@pytest.fixture
def log_in(web: Starlette) -> Iterator[Callable[[str], Operator]]:
    """``log_in(name)``: an operator on a client of their own (closed at the end of the test)."""
    with ExitStack() as clients:
        def operator(name: str) -> Operator:
            return Operator(clients.enter_context(TestClient(web, base_url="http://127.0.0.1")), name)
        yield operator


def _letter_path(letter: int, action: str) -> str:
    return f"/groups/{GROUP}/dead-letters/{letter}/{action}"


def _started(log: Path, n: int) -> bool:
    return any(s.what == "start" and s.n == n for s in steps(log))


def _shown(dsn: str, letter: int) -> tuple[DeadLetter, list[Change]]:
    return show_dead_letter(Settings(dsn=dsn), letter)


def _history(dsn: str, letter: int) -> list[tuple[str, str, str]]:
    return [(c.by_user, c.action, c.to_status) for c in _shown(dsn, letter)[1]]


def test_two_operators_replaying_two_letters_at_once_each_land_once_and_a_failure_keeps_its_letter_dead(
        pg_dsn: str, log_in: Callable[[str], Operator], replay_log: Path) -> None:
    # Ann's handler waits, then writes; Bob's writes, waits past Ann's write, then raises.
    a = dead_letter(pg_dsn, {"n": 1, "hold": 2})
    b = dead_letter(pg_dsn, {"n": 2, "early": True, "hold": 2.5, "fail": True})
    ann, bob = log_in("ann"), log_in("bob")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(ann.act, _letter_path(a, "replay"), reason="fixed")
        wait_until(lambda: _started(replay_log, 1), 30, what="Ann's replay in its handler")
        second = pool.submit(bob.act, _letter_path(b, "replay"), reason="try again")
        by_ann, by_bob = first.result(60), second.result(60)

    assert by_ann.said == f"replayed dead letter {a}"
    assert by_bob.said.startswith(f"dead letter {b} failed again: RuntimeError: order 2 failed on purpose")
    assert effect_counts(pg_dsn) == {1: 1}, "Ann's effect once, none of Bob's"
    assert _history(pg_dsn, a) == [("ann", "replay", "replayed")]
    letter, _ = _shown(pg_dsn, b)
    assert (letter.status, letter.attempts) == ("dead", 2) and "order 2 failed on purpose" in letter.error
    assert _history(pg_dsn, b) == [("bob", "replay", "dead")]
    found = steps(replay_log)
    assert by_bob.sent_at < when(found, "end", 1) - 1, "Bob asked while Ann's handler ran"
    assert [(s.what, s.n) for s in found] == [("setup", None), ("start", 1), ("end", 1), ("teardown", None),
                                              ("setup", None), ("start", 2), ("end", 2), ("teardown", None)]


def test_a_replay_of_every_matching_letter_beside_a_single_replay_replays_each_once(
        pg_dsn: str, log_in: Callable[[str], Operator], replay_log: Path) -> None:
    bulk = [dead_letter(pg_dsn, {"n": n, "hold": 0.4, **({"early": True, "fail": True} if n == 13 else {})},
                        topic="bulk") for n in (11, 12, 13, 14)]
    single = dead_letter(pg_dsn, {"n": 21, "hold": 0.5}, topic="single")
    ann, bob = log_in("ann"), log_in("bob")
    with ThreadPoolExecutor(2) as pool:
        walk = pool.submit(ann.act, f"/groups/{GROUP}/dead-letters/matching/replay", topic="bulk", reason="all")
        wait_until(lambda: _started(replay_log, 11), 30, what="Ann's walk in its first handler")
        one = pool.submit(bob.act, _letter_path(single, "replay"), reason="just this one")
        by_ann, by_bob = walk.result(60), one.result(60)

    assert by_ann.said == "replay: done 3, failed 1, skipped 0, remaining 0"
    assert by_bob.said == f"replayed dead letter {single}"
    assert effect_counts(pg_dsn) == {11: 1, 12: 1, 14: 1, 21: 1}
    for letter in bulk:
        status = "dead" if letter == bulk[2] else "replayed"
        assert _history(pg_dsn, letter) == [("ann", "replay", status)], letter
    assert _shown(pg_dsn, bulk[2])[0].attempts == 2
    assert _history(pg_dsn, single) == [("bob", "replay", "replayed")]
    found = steps(replay_log)
    assert by_bob.sent_at < when(found, "end", 11), "Bob asked while Ann's walk ran"
    assert when(found, "start", 21) > when(found, "end", 14), "Bob's replay waited for Ann's walk"
    assert [s.what for s in found].count("setup") == 2 and [s.what for s in found][-4:] == [
        "setup", "start", "end", "teardown"]


def test_discards_and_resolves_sent_at_once_each_act_once(
        pg_dsn: str, log_in: Callable[[str], Operator], replay_log: Path) -> None:
    d1, d2, d3, d4 = (dead_letter(pg_dsn, {"n": n}) for n in (31, 32, 33, 34))
    held = dead_letter(pg_dsn, {"n": 35, "hold": 2})
    asks = [("ann", d1, "discard"), ("bob", d1, "discard"),  # the same letter, the same action
            ("cy", d2, "discard"), ("dee", d2, "resolve"),  # the same letter, two actions
            ("ann", d3, "resolve"), ("bob", d4, "discard"),  # two letters
            ("cy", held, "discard")]  # a letter being replayed
    # A client (a browser tab) per request: a page shows its session's latest outcome.
    tabs = [log_in(name) for name, _, _ in asks]
    gate = threading.Barrier(len(asks))

    def at_once(tab: Operator, letter: int, action: str) -> Acted:
        gate.wait(30)
        return tab.act(_letter_path(letter, action), reason=f"{action} by {tab.name}")

    with ThreadPoolExecutor(len(asks) + 1) as pool:
        replaying = pool.submit(log_in("dee").act, _letter_path(held, "replay"), reason="fixed")
        wait_until(lambda: _started(replay_log, 35), 30, what="Dee's replay in its handler")
        said = [f.result(60) for f in [pool.submit(at_once, tab, letter, action)
                                       for tab, (_, letter, action) in zip(tabs, asks, strict=True)]]
        assert replaying.result(60).said == f"replayed dead letter {held}"

    outcomes = {ask: acted.said for ask, acted in zip(asks, said, strict=True)}
    first, second = sorted([outcomes[("ann", d1, "discard")], outcomes[("bob", d1, "discard")]],
                           key=lambda said: said != f"discarded dead letter {d1}")
    assert first == f"discarded dead letter {d1}", outcomes
    assert second == "already discarded" or BUSY in second, outcomes
    assert [h[1:] for h in _history(pg_dsn, d1)] == [("discard", "discarded")]
    [(by, action, status)] = _history(pg_dsn, d2)
    other = ("dee", d2, "resolve") if by == "cy" else ("cy", d2, "discard")
    assert outcomes[(by, d2, action)] == f"{status} dead letter {d2}", outcomes
    assert "nothing" in outcomes[other] and "dead letter" in outcomes[other], outcomes
    assert _history(pg_dsn, d3) == [("ann", "resolve", "resolved")]
    assert _history(pg_dsn, d4) == [("bob", "discard", "discarded")]
    assert BUSY in outcomes[("cy", held, "discard")]
    assert _history(pg_dsn, held) == [("dee", "replay", "replayed")]
    assert effect_counts(pg_dsn) == {35: 1}


def test_a_replay_that_waits_too_long_for_the_groups_processor_is_refused_and_replays_nothing(
        pg_dsn: str, log_in: Callable[[str], Operator], replay_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replays, "BUSY_WAIT_S", 0.5)
    a, b = dead_letter(pg_dsn, {"n": 1, "hold": 2.5}), dead_letter(pg_dsn, {"n": 2})
    ann, bob = log_in("ann"), log_in("bob")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ann.act, _letter_path(a, "replay"))
        wait_until(lambda: _started(replay_log, 1), 30, what="Ann's replay in its handler")
        refused = bob.act(_letter_path(b, "replay"))
        assert not first.done(), "refused while Ann's replay still ran"
        assert first.result(60).said == f"replayed dead letter {a}"
    assert refused.said == (f"another replay through the processor of group '{GROUP}' (SlowReplay) is running: "
                            "try again when it has finished; nothing was replayed")
    letter, history = _shown(pg_dsn, b)
    assert (letter.status, letter.attempts, history) == ("dead", 1, [])
    assert effect_counts(pg_dsn) == {1: 1}
    assert bob.act(_letter_path(b, "replay")).said == f"replayed dead letter {b}"  # once Ann's has finished
    assert effect_counts(pg_dsn) == {1: 1, 2: 1}
