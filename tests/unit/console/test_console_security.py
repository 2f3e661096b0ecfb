"""The console against a hostile visitor, on SQLite through Starlette's test client: logins that end,
cookies, error text that reveals nothing, names of any characters, bad parameters, headers."""

from __future__ import annotations

import html
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from kstore import Processor, Settings, migrate
from kstore.console import app
from kstore.db import deadletters
from kstore.db.store import Store, make_engine
from kstore.db.writes import now
from kstore.errors import ConfigurationError, NotMigratedError
from kstore.types import Message
from tests.support.console_pages import (
    GROUP,
    PASSWORD,
    add_letter,
    console_client,
    csrf_of,
    log_in,
    seeded_dsn,
    statuses,
)

SECRET = "SuperSecretKey123"


def _offsets_of(dsn: str, *groups: str) -> None:
    settings = Settings(dsn=dsn)
    engine = make_engine(settings)
    with engine.begin() as conn:
        for group in groups:
            conn.execute(Store(engine, settings).offsets.insert().values(
                consumer_group=group, topic="t", partition_id=0, next_offset=1, epoch=1, updated_at=now()))
    engine.dispose()


def _use_cookie(client: TestClient, token: str) -> None:
    """Send ``token`` as the login cookie from now on (as whoever copied it would)."""
    client.cookies.clear()
    client.cookies.set("kstore_console", token)


def _cookie(client: TestClient, name: str = "kstore_console") -> str:
    found = client.cookies.get(name)
    assert found, client.cookies
    return found


# --- Logins kept on the server ---------------------------------------------------------------------------


def test_after_logout_a_saved_cookie_and_token_act_no_more(client: TestClient, dsn: str) -> None:
    token = log_in(client)
    saved = _cookie(client)
    r = client.post("/logout", data={"csrf_token": token})
    assert r.status_code == 200 and 'id="login"' in r.text
    _use_cookie(client, saved)  # an attacker who copied the cookie before the logout
    assert client.get("/", follow_redirects=False).status_code == 303
    r = client.post(f"/groups/{GROUP}/dead-letters/1/discard", data={"csrf_token": token, "reason": "stolen"})
    assert r.status_code == 401
    assert statuses(dsn) == {deadletters.DEAD}


def test_a_new_console_password_ends_every_login_made_under_the_old_one(dsn: str) -> None:
    key = "k" * 40  # a key of its own: logins outlive a restart
    with console_client(dsn, console_password=PASSWORD, console_session_key=key) as before:
        log_in(before)
        saved = _cookie(before)
    with console_client(dsn, console_password="a-new-Passw0rd-now", console_session_key=key) as after:
        _use_cookie(after, saved)
        assert after.get("/", follow_redirects=False).status_code == 303
    with console_client(dsn, console_password=PASSWORD, console_session_key=key) as same:
        _use_cookie(same, saved)
        assert same.get("/", follow_redirects=False).status_code == 200


def test_without_a_key_of_its_own_a_restart_ends_every_login(dsn: str) -> None:
    with console_client(dsn, console_password=PASSWORD) as before:
        log_in(before)
        saved = _cookie(before)
    with console_client(dsn, console_password=PASSWORD) as after:
        _use_cookie(after, saved)
        assert after.get("/", follow_redirects=False).status_code == 303


def test_the_cookie_holds_only_a_random_token_and_the_database_only_its_hash(client: TestClient, dsn: str) -> None:
    log_in(client, "ann")
    token = _cookie(client)
    assert "ann" not in token and len(token) >= 40
    engine = make_engine(Settings(dsn=dsn))
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT token_sha256, operator FROM kstore_console_sessions")).all()
    engine.dispose()
    assert [r.operator for r in rows] == ["ann"] and token not in rows[0].token_sha256


def test_logging_in_again_gives_a_new_token_and_ends_the_old_one(client: TestClient) -> None:
    log_in(client, "ann")
    first = _cookie(client)
    log_in(client, "bob")
    assert _cookie(client) != first
    _use_cookie(client, first)
    assert client.get("/", follow_redirects=False).status_code == 303


def test_the_outcome_of_an_action_is_kept_on_the_server_however_long(dsn: str) -> None:
    class Boom(Processor):
        group = GROUP

        def handle(self, msg: Message) -> None:
            raise ValueError("x" * 20_000)

    web = app(Settings(dsn=dsn, bootstrap_servers="127.0.0.1:1", console_sample_interval_s=0,
                       console_password=PASSWORD), processors={GROUP: Boom()})
    with TestClient(web, base_url="http://127.0.0.1") as client:
        token = log_in(client)
        r = client.post(f"/groups/{GROUP}/dead-letters/2/replay", data={"csrf_token": token, "reason": "again"},
                        follow_redirects=False)
        assert r.status_code == 303
        assert all(len(c) < 200 for c in r.headers.get_list("set-cookie")), r.headers.get_list("set-cookie")
        page = client.get(r.headers["location"]).text
        assert re.search(r'id="flash">dead letter 2 failed again: ValueError: x{20000}<', page)
        assert 'id="flash"' not in client.get(r.headers["location"]).text  # shown once


@pytest.mark.parametrize("scheme,forced,secure", [("https", False, True), ("http", False, False),
                                                   ("http", True, True)])
def test_cookies_are_secure_over_https_or_when_forced(dsn: str, scheme: str, forced: bool, secure: bool) -> None:
    web = app(Settings(dsn=dsn, console_sample_interval_s=0, console_password=PASSWORD,
                       console_secure_cookie=forced))
    with TestClient(web, base_url=f"{scheme}://127.0.0.1") as client:
        form = client.get("/login")
        r = client.post("/login", data={"csrf_token": csrf_of(form.text), "operator": "ann", "password": PASSWORD},
                        follow_redirects=False)
        cookies = form.headers.get_list("set-cookie") + r.headers.get_list("set-cookie")
        # Over plain HTTP a forced Secure cookie is not sent back: no login is made there, as in a browser.
        made = {"kstore_console_form"} | ({"kstore_console"} if scheme == "https" or not forced else set())
        assert {c.split("=")[0] for c in cookies} == made
        for cookie in cookies:
            flags = {f.strip().lower() for f in cookie.split(";")[1:]}
            assert {"httponly", "samesite=strict"} <= flags
            assert ("secure" in flags) == secure, cookie


def test_a_password_shorter_than_twelve_characters_is_refused(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="console_password is 11 characters: give at least 12"):
        app(Settings(dsn=dsn, console_password="p" * 11))


# --- What a visitor sends is never put beside a secret -----------------------------------------------------


def test_error_text_answers_a_right_guess_of_a_secret_as_it_answers_a_wrong_one(dsn: str) -> None:
    settings = {"console_read_only": True, "schema_registry_url": "http://127.0.0.1:1",
                "schema_registry_password": SECRET, "sasl_password": SECRET + "-sasl"}
    with console_client(dsn, **settings) as client:
        answers = {}
        for guess in (SECRET, "WrongGuess1234567", SECRET + "-sasl"):
            r = client.get(f"/groups/{GROUP}/dead-letters", params={"since": f"a b {guess} c"})
            assert r.status_code == 400
            error = re.search(r'id="error">([^<]*)<', r.text)
            assert error and guess not in error.group(1)
            answers[guess] = r.text.replace(guess, "GUESS")
        assert len(set(answers.values())) == 1
        assert "***" not in answers[SECRET]


def test_a_console_password_that_is_also_an_ordinary_word_is_not_masked_out_of_the_pages(tmp_path: Path) -> None:
    word = "orders-ledger"  # the console's password, and the name of its database's file
    dsn = seeded_dsn(tmp_path, f"{word}.db")
    with console_client(dsn, console_password=word) as client:
        token = csrf_of(client.get("/login").text)
        page = client.post("/login", data={"csrf_token": token, "operator": "ann", "password": word}).text
        assert f"/{word}.db" in page and "***" not in page
        r = client.post(f"/groups/{GROUP}/dead-letters/1/resolve", data={"csrf_token": csrf_of(page), "reason": ""})
        assert "give a reason" in r.text and f"/{word}.db" in r.text and "***" not in r.text


def test_the_login_page_names_no_database(client: TestClient, dsn: str) -> None:
    page = client.get("/login").text
    assert "kstore.db" not in page and "sqlite" not in page
    log_in(client)
    assert "kstore.db" in client.get("/").text  # an operator sees which database this is


# --- Any name Kafka allows -----------------------------------------------------------------------------------

HOSTILE = ["a/b", "q?x=1", "h#frag", "p%2Fq", "100%", "..", ".", "sp ace", "<script>x</script>", "ü/ñ", "&amp;"]


def test_every_group_name_links_to_its_own_pages_and_its_actions_reach_its_letters(client: TestClient,
                                                                                    dsn: str) -> None:
    _offsets_of(dsn, *HOSTILE)
    engine = make_engine(Settings(dsn=dsn))
    t = deadletters.build_table()
    with engine.begin() as conn:
        for group in HOSTILE:
            add_letter(conn, t, 100, "ValueError: bad")
            conn.execute(t.update().where(t.c.offset == 100).values(consumer_group=group, offset=101))
        ids = dict(conn.execute(sa.select(t.c.consumer_group, t.c.id).where(t.c.offset == 101)).all())
    engine.dispose()
    token = log_in(client)
    page = client.get("/")
    assert page.status_code == 200
    links = {html.unescape(text): html.unescape(href)
             for href, text in re.findall(r'<li><a href="([^"]+)">([^<]*)</a></li>', page.text)}
    assert set(HOSTILE) <= set(links)
    for group in HOSTILE:
        overview = client.get(links[group])
        assert overview.status_code == 200 and f"<title>{html.escape(group)}: kstore console</title>" in overview.text
        letters = client.get(links[group] + "/dead-letters")
        assert letters.status_code == 200, group
        [letter_link] = re.findall(r'<tr class="letter"><td><a href="([^"]+)">', letters.text)
        letter = client.get(html.unescape(letter_link))
        assert letter.status_code == 200 and f'<span id="letter-id">{ids[group]}</span>' in letter.text, group
        action = re.search(r'action="([^"]+/discard)"', letter.text)
        assert action, group
        r = client.post(html.unescape(action.group(1)), data={"csrf_token": token, "reason": "hostile name"})
        assert r.status_code == 200 and f"discarded dead letter {ids[group]}" in r.text, group
    assert statuses(dsn, deadletters.DISCARDED) == sorted(ids.values())
    assert statuses(dsn, deadletters.DEAD) == list(range(1, 8))


# --- Bad parameters: a 4xx, with the security headers ----------------------------------------------------------


@pytest.mark.parametrize("path,status", [
    (f"/groups/{GROUP}/dead-letters?after=abc", 400),
    (f"/groups/{GROUP}/dead-letters?after=99999999999999999999", 400),
    (f"/groups/{GROUP}/dead-letters?partition=99999999999", 400),
    (f"/groups/{GROUP}/dead-letters?status=weird", 400),
    (f"/groups/{GROUP}/dead-letters?until=yesterday", 400),
    (f"/groups/{GROUP}/dead-letters?since=2026-01-01T00:00:00", 400),
    (f"/groups/{GROUP}/dead-letters/99999999999999999999", 404),
    (f"/groups/{GROUP}/dead-letters/999999999999999999", 404),  # fits the column: a letter not there
    (f"/groups/{GROUP}/partitions/t/99999999999", 404),
    ("/nowhere", 404),
])
def test_a_bad_parameter_is_a_4xx_with_the_security_headers(client: TestClient, path: str, status: int) -> None:
    log_in(client)
    r = client.get(path)
    assert r.status_code == status, r.text
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"


@pytest.mark.parametrize("form,field", [
    ({"topic": "t", "target": "offset", "value": "abc"}, "offset"),
    ({"topic": "t", "target": "offset", "value": "99999999999999999999"}, "offset"),
    ({"topic": "t", "target": "shift", "value": "1.5"}, "shift"),
    ({"topic": "t", "target": "datetime", "value": "soon"}, "time"),
    ({"topic": "t", "partitions": "0,x", "target": "earliest"}, "partitions"),
    ({"topic": "t", "partitions": "99999999999", "target": "earliest"}, "partitions"),
    ({"topic": "t", "target": "nowhere"}, "target"),
    ({"topic": "", "target": "earliest"}, "topic"),
])
def test_a_bad_reset_form_is_a_400_that_names_the_field(client: TestClient, form: dict[str, str],
                                                         field: str) -> None:
    token = log_in(client)
    for action in ("plan", "execute"):
        r = client.post(f"/groups/{GROUP}/offsets/{action}", data={"csrf_token": token, "reason": "r", **form})
        assert r.status_code == 400 and f"{field}: give " in r.text, (action, r.text)


def test_an_error_nothing_caught_is_a_500_with_the_security_headers(dsn: str) -> None:
    def broken(request: object) -> Response:
        raise RuntimeError("a bug")

    web = app(Settings(dsn=dsn, console_sample_interval_s=0, console_read_only=True))
    web.router.routes.append(Route("/broken", broken))
    with TestClient(web, raise_server_exceptions=False) as client:
        r = client.get("/broken")
    assert r.status_code == 500
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff" and "a bug" not in r.text


def test_times_are_shown_with_their_timezone(client: TestClient) -> None:
    log_in(client)
    page = client.get(f"/groups/{GROUP}/dead-letters").text
    assert len(re.findall(r"<td>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ</td>", page)) == 7


def test_a_console_that_acts_refuses_to_start_on_a_database_without_its_logins_table(tmp_path: Path) -> None:
    dsn = f"sqlite:///{tmp_path / 'old.db'}"
    migrate(Settings(dsn=dsn), "0013")
    with pytest.raises(NotMigratedError, match="is at migration 0013, need 0015: run `kstore migrate"):
        app(Settings(dsn=dsn, console_password=PASSWORD))
    app(Settings(dsn=dsn, console_read_only=True))  # reading needs no logins


def test_a_console_whose_database_does_not_answer_says_so_and_logs_no_one_in() -> None:
    web = app(Settings(dsn="postgresql+psycopg2://kstore@127.0.0.1:1/nowhere", console_password=PASSWORD,
                       console_sample_interval_s=0, db_timeout_s=1))
    with TestClient(web) as client:
        form = client.get("/login")
        assert form.status_code == 200  # a login form asks nothing of the database
        r = client.post("/login", data={"csrf_token": csrf_of(form.text), "operator": "ann", "password": PASSWORD})
        assert r.status_code == 503 and "database does not answer" in r.text and not r.cookies.get("kstore_console")
        client.cookies.set("kstore_console", "a-token-from-before-the-outage")
        r = client.get("/")
    assert r.status_code == 503 and "database does not answer" in r.text
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_two_tabs_acting_at_once_each_show_their_own_outcome(client: TestClient) -> None:
    token = log_in(client)
    tab = TestClient(client.app, base_url="http://127.0.0.1")
    tab.cookies.update(client.cookies)
    barrier = threading.Barrier(2)

    def act(browser: TestClient, letter: int, action: str) -> str:
        barrier.wait()
        r = browser.post(f"/groups/{GROUP}/dead-letters/{letter}/{action}",
                         data={"csrf_token": token, "reason": "two tabs"}, follow_redirects=False)
        assert r.status_code == 303
        return str(r.headers["location"])

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(act, client, 1, "discard")
        second = pool.submit(act, tab, 3, "resolve")
        pages = {1: first.result(), 3: second.result()}
    assert 'id="flash">discarded dead letter 1<' in client.get(pages[1]).text
    assert 'id="flash">resolved dead letter 3<' in client.get(pages[3]).text
