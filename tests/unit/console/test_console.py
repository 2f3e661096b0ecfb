"""The web console on SQLite, through Starlette's test client: login, CSRF, read-only, secrets, actions.

The brokers are not needed for these pages (the overview's are, and are in the integration tests).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from kstore import Settings
from kstore.console import app
from kstore.console.auth import LoginThrottle
from kstore.console.sampling import Sampler, svg_chart, throughput
from kstore.db import deadletters, samples
from kstore.db.store import Store, make_engine
from kstore.errors import BrokerError, ConfigurationError, KstoreError
from kstore.ops.lag import GroupReading, PartitionReading
from tests.support.console_pages import GROUP, PASSWORD, console_client, csrf_of, log_in, statuses
from tests.support.harness import wait_until


def test_a_console_that_can_act_refuses_to_start_without_a_login_configured(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="needs a login"):
        app(Settings(dsn=dsn))


def test_every_page_redirects_to_the_login_without_one(client: TestClient) -> None:
    for path in ("/", f"/groups/{GROUP}", f"/groups/{GROUP}/dead-letters", f"/groups/{GROUP}/dead-letters/1",
                 f"/groups/{GROUP}/offsets", f"/groups/{GROUP}/outbox"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("http://127.0.0.1/login?next="), path


def test_a_wrong_password_is_refused_and_sets_no_operator(client: TestClient) -> None:
    token = csrf_of(client.get("/login").text)
    r = client.post("/login", data={"csrf_token": token, "operator": "ann", "password": "wrong"})
    assert r.status_code == 401
    assert client.get("/", follow_redirects=False).status_code == 303


def test_failed_logins_from_one_address_are_refused_for_a_while_the_right_password_too(dsn: str) -> None:
    web = app(Settings(dsn=dsn, bootstrap_servers="127.0.0.1:1", console_sample_interval_s=0,
                       console_password=PASSWORD))
    with TestClient(web, base_url="http://127.0.0.1", client=("10.0.0.1", 1)) as guesser, \
            TestClient(web, base_url="http://127.0.0.1", client=("10.0.0.2", 1)) as operator:
        token = csrf_of(guesser.get("/login").text)
        for n in range(5):
            r = guesser.post("/login", data={"csrf_token": token, "operator": "eve", "password": f"guess{n}"})
            assert r.status_code == 401, n
        r = guesser.post("/login", data={"csrf_token": token, "operator": "eve", "password": PASSWORD})
        assert r.status_code == 429 and "too many failed logins" in r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 300
        assert guesser.get("/", follow_redirects=False).status_code == 303, "the right password let nobody in"
        log_in(operator)  # another address is not held up


def test_the_login_throttle_lets_an_address_try_again_once_its_failures_leave_the_window() -> None:
    throttle = LoginThrottle("2 per 1 second")
    throttle.failed("a")
    assert throttle.wait_s("a") == 0
    throttle.failed("a")
    assert 0 < throttle.wait_s("a") <= 1.0
    assert throttle.wait_s("b") == 0
    wait_until(lambda: throttle.wait_s("a") == 0, 5, interval=0.05, what="the failures to leave the window")


def test_a_login_without_the_forms_csrf_token_is_refused(client: TestClient) -> None:
    client.get("/login")
    r = client.post("/login", data={"csrf_token": "forged", "operator": "ann", "password": PASSWORD})
    assert r.status_code == 403 and "CSRF" in r.text
    assert client.get("/", follow_redirects=False).status_code == 303


def test_every_action_is_refused_without_a_login(client: TestClient, dsn: str) -> None:
    token = csrf_of(client.get("/login").text)
    for path in (f"/groups/{GROUP}/dead-letters/1/discard", f"/groups/{GROUP}/dead-letters/1/resolve",
                 f"/groups/{GROUP}/dead-letters/1/replay", f"/groups/{GROUP}/dead-letters/matching/discard",
                 f"/groups/{GROUP}/offsets/plan", f"/groups/{GROUP}/offsets/execute"):
        r = client.post(path, data={"csrf_token": token, "reason": "r", "topic": "t", "target": "earliest"})
        assert r.status_code == 401, path
    assert statuses(dsn) == {deadletters.DEAD}


def test_every_action_is_refused_with_a_bad_csrf_token(client: TestClient, dsn: str) -> None:
    log_in(client)
    for path in (f"/groups/{GROUP}/dead-letters/1/discard", f"/groups/{GROUP}/dead-letters/1/resolve",
                 f"/groups/{GROUP}/dead-letters/matching/resolve", f"/groups/{GROUP}/offsets/execute", "/logout"):
        for data in ({"csrf_token": "forged", "reason": "r"}, {"reason": "r"}):
            r = client.post(path, data=data)
            assert r.status_code == 403 and "CSRF" in r.text, path
    assert statuses(dsn) == {deadletters.DEAD}


def test_a_read_only_console_shows_without_a_login_hides_its_forms_and_refuses_actions(
        read_only: TestClient, dsn: str) -> None:
    page = read_only.get(f"/groups/{GROUP}/dead-letters/1")
    assert page.status_code == 200 and "v1" in page.text and "read-only" in page.text
    assert "<form" not in page.text and 'id="discard"' not in page.text
    for path in (f"/groups/{GROUP}/dead-letters/1/discard", f"/groups/{GROUP}/offsets/plan", "/login"):
        r = read_only.post(path, data={"reason": "r"})
        assert r.status_code == 403, path
    assert statuses(dsn) == {deadletters.DEAD}


def test_discarding_a_letter_records_the_operator_and_the_reason(client: TestClient, dsn: str) -> None:
    token = log_in(client, "ann")
    r = client.post(f"/groups/{GROUP}/dead-letters/3/discard", data={"csrf_token": token, "reason": "a test order"})
    assert r.status_code == 200 and "discarded dead letter 3" in r.text
    assert '<td class="by">ann@' in r.text and "a test order" in r.text
    letters, changes = deadletters.show_dead_letter(Settings(dsn=dsn), 3)
    assert letters.status == deadletters.DISCARDED
    assert [(c.by_user, c.reason) for c in changes] == [("ann", "a test order")]


def test_an_action_that_fails_says_why_on_the_page_and_changes_nothing(client: TestClient, dsn: str) -> None:
    token = log_in(client)
    r = client.post(f"/groups/{GROUP}/dead-letters/3/resolve", data={"csrf_token": token, "reason": ""})
    assert r.status_code == 200 and 'id="flash"' in r.text and "give a reason" in r.text
    r = client.post(f"/groups/{GROUP}/dead-letters/3/replay", data={"csrf_token": token, "reason": "x"})
    assert "--processor" in r.text
    assert statuses(dsn) == {deadletters.DEAD}


def test_the_list_filters_and_pages_and_a_filter_resolves_what_it_matches(client: TestClient, dsn: str) -> None:
    token = log_in(client)
    r = client.get(f"/groups/{GROUP}/dead-letters", params={"error_type": "KeyError"})
    assert re.findall(r'dead-letters/(\d+)">', r.text) == ["2", "4", "6"]
    r = client.get(f"/groups/{GROUP}/dead-letters", params={"partition": "1", "error": "BAD"})
    assert re.findall(r'dead-letters/(\d+)">', r.text) == ["1", "3", "5", "7"]
    r = client.post(f"/groups/{GROUP}/dead-letters/matching/resolve",
                    data={"csrf_token": token, "reason": "sku fixed", "error_type": "KeyError"})
    assert "resolve: done 3" in r.text
    assert statuses(dsn, "resolved") == [2, 4, 6]
    r = client.get(f"/groups/{GROUP}/dead-letters", params={"partition": "x"})
    assert r.status_code == 400 and 'id="error">partition: give a whole number' in r.text


def test_no_page_shows_a_password_of_the_settings(dsn: str) -> None:
    secret = "db-s3cret-PW"
    # Read-only: a console that acts keeps its logins in the database, and this one does not answer.
    web = app(Settings(dsn=f"postgresql+psycopg2://kstore:{secret}@127.0.0.1:1/nowhere", console_read_only=True,
                       console_password=PASSWORD, console_session_key="k" * 40, console_sample_interval_s=0,
                       db_timeout_s=1))
    with TestClient(web, base_url="http://127.0.0.1") as client:
        pages = [client.get("/").text, client.get(f"/groups/{GROUP}/dead-letters").text,
                 client.get(f"/groups/{GROUP}/offsets").text,
                 client.get(f"/groups/{GROUP}/outbox").text]
    for page in pages:
        assert secret not in page and PASSWORD not in page and "k" * 40 not in page
    assert "127.0.0.1:1/nowhere" in pages[0] and 'id="error"' in pages[0]


def test_pages_forbid_framing_and_caching(client: TestClient) -> None:
    r = client.get("/login")
    assert r.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert r.headers["cache-control"] == "no-store"
    assert "samesite=strict" in r.headers["set-cookie"].lower() and "httponly" in r.headers["set-cookie"].lower()


def test_the_login_only_sends_back_to_a_path_of_the_console(client: TestClient) -> None:
    token = csrf_of(client.get("/login").text)
    r = client.post("/login", data={"csrf_token": token, "operator": "ann", "password": PASSWORD,
                                    "next": "//evil.example/x"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "http://127.0.0.1/"


def test_a_trusted_header_names_the_operator(dsn: str) -> None:
    with console_client(dsn, console_user_header="X-Forwarded-User") as client:
        assert client.get("/", follow_redirects=False).status_code == 303
        r = client.get(f"/groups/{GROUP}/dead-letters/5", headers={"X-Forwarded-User": "bob"})
        assert r.status_code == 200 and '<span id="operator">bob</span>' in r.text
        r = client.post(f"/groups/{GROUP}/dead-letters/5/resolve", headers={"X-Forwarded-User": "bob"},
                        data={"csrf_token": csrf_of(r.text), "reason": "done by hand"})
        assert "resolved dead letter 5" in r.text
    assert [c.by_user for c in deadletters.show_dead_letter(Settings(dsn=dsn), 5)[1]] == ["bob"]


def _reading(group: str, at: float, lag: int, stored: int) -> GroupReading:
    return GroupReading(group, at, [PartitionReading("t", 0, stored, 0, stored + lag, lag, 1.5, 1, None, 0)], 2)


def test_sampling_writes_every_group_and_keeps_the_table_bounded(dsn: str) -> None:
    settings = Settings(dsn=dsn)
    engine = make_engine(settings)
    store = Store(engine, settings)
    start = datetime.now(timezone.utc).timestamp() - 100
    clock = [start]

    def read_all() -> tuple[list[GroupReading], dict[str, KstoreError]]:
        # One message a second: the stored offset moves with the samples' clock (never wraps around).
        # A third group the brokers could not answer for is left out of this sample.
        return ([_reading(group, clock[0], lag=40 + n, stored=1000 + int(clock[0] - start))
                 for n, group in enumerate((GROUP, "other"))], {"third": BrokerError("no answer")})

    sampler = Sampler(store, read_all, interval_s=10, retention_s=30)
    for _ in range(6):
        assert [s.group for s in sampler.sample_once()] == [GROUP, "other"]
        clock[0] += 10
    kept = sampler.history(GROUP, timedelta(hours=1))
    assert [s.lag_messages for s in kept] == [40] * 4  # 50 s of samples, 30 s kept (the newest and 3 before)
    assert [s.lag_messages for s in sampler.history("other", timedelta(hours=1))] == [41] * 4
    # Each partition's samples too, for its own chart, kept as long (the retention is under an hour).
    kept_partition = sampler.partition_history("other", "t", 0)
    assert [(s.lag_messages, s.stored_offsets) for s in kept_partition] == [(41, s.stored_offsets) for s in kept]
    assert sampler.partition_history("other", "t", 1) == []
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(samples.build_table())).scalar_one() == 8
        assert conn.execute(sa.select(sa.func.count()).select_from(samples.build_partition_table())).scalar_one() == 8
    rates = throughput(kept)
    assert [round(r, 3) for _, r in rates] == [1.0, 1.0, 1.0]
    assert "<polyline" in svg_chart("lag", [(s.at, float(s.lag_messages)) for s in kept], "messages")
    assert "not enough samples" in svg_chart("lag", [], "messages")
    engine.dispose()
