"""``kstore console`` over real HTTP believes ``X-Forwarded-For`` and ``X-Forwarded-Proto`` only from
the proxies it is told to trust: without one, a client cannot give each failed login a new address
to escape the login throttle, whatever ``FORWARDED_ALLOW_IPS`` says; behind a trusted proxy each of
its clients is counted apart. A trusted proxy that is not an address is one clear line at start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from tests.support.browser import PASSWORD, ConsoleProcess
from tests.support.harness import REPO_DIR, SUPPORT_DIR

pytestmark = pytest.mark.integration

CSRF = re.compile(r'name="csrf_token"\s+value="([^"]+)"')
#: Failed logins one address may make before the throttle answers 429 (kstore.console.auth).
ALLOWED_FAILURES = 5


def log_in(client: httpx.Client, password: str, forwarded_for: str | None = None) -> httpx.Response:
    """One login through the form, as a browser would (the form's token, the cookies kept by the
    client), its requests carrying ``X-Forwarded-For: forwarded_for`` when given."""
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
    page = client.get("/login", headers=headers)
    assert page.status_code == 200, page.text
    token = CSRF.search(page.text)
    assert token, page.text
    return client.post("/login", headers=headers,
                       data={"csrf_token": token.group(1), "operator": "mallory", "password": password})


def test_a_client_cannot_escape_the_login_throttle_with_a_new_x_forwarded_for_each_time(
        sqlite_dsn: str, console: Callable[..., ConsoleProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    # uvicorn's own default would trust every client with this: the console must not read it.
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    proc = console(sqlite_dsn, "proxy-untrusted")
    with httpx.Client(base_url=proc.url, timeout=30) as client:
        answers = [log_in(client, "wrong", forwarded_for=f"203.0.113.{n}").status_code
                   for n in range(1, ALLOWED_FAILURES + 2)]
        assert answers == [401] * ALLOWED_FAILURES + [429]
        right = log_in(client, PASSWORD, forwarded_for="203.0.113.200")
        assert right.status_code == 429, right.text
        assert int(right.headers["Retry-After"]) > 0
        # Nor is the scheme taken from the header: the redirect to the login stays on http.
        redirect = client.get("/", headers={"X-Forwarded-Proto": "https"})
        assert redirect.status_code == 303
        assert not redirect.headers["Location"].startswith("https:"), redirect.headers["Location"]


def test_behind_a_trusted_proxy_each_forwarded_client_is_throttled_apart(
        sqlite_dsn: str, console: Callable[..., ConsoleProcess]) -> None:
    proc = console(sqlite_dsn, "proxy-trusted", "--trusted-proxy", "127.0.0.1")
    with httpx.Client(base_url=proc.url, timeout=30) as guesser, \
            httpx.Client(base_url=proc.url, timeout=30) as operator:
        answers = [log_in(guesser, "wrong", forwarded_for="10.0.0.1").status_code
                   for _ in range(ALLOWED_FAILURES + 1)]
        assert answers == [401] * ALLOWED_FAILURES + [429]
        assert log_in(guesser, PASSWORD, forwarded_for="10.0.0.1").status_code == 429
        # Another client of the same proxy has a count of its own, and logs in.
        assert log_in(operator, "mistyped", forwarded_for="10.0.0.2").status_code == 401
        assert log_in(operator, PASSWORD, forwarded_for="10.0.0.2").status_code == 303
        # The proxy says the client came over https, and the console believes it.
        redirect = guesser.get("/", headers={"X-Forwarded-Proto": "https"})
        assert redirect.status_code == 303
        assert redirect.headers["Location"].startswith("https://"), redirect.headers["Location"]


def test_a_trusted_proxy_that_is_not_an_address_stops_the_console_with_one_clear_line(sqlite_dsn: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kstore", "console", "--dsn", sqlite_dsn, "--password-file", os.devnull,
         "--trusted-proxy", "127.0.0.1", "--trusted-proxy", "not-an-ip"],
        capture_output=True, text=True, timeout=60, cwd=SUPPORT_DIR, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(SUPPORT_DIR), str(REPO_DIR)))})
    assert r.returncode != 0, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kstore: error: "), lines[0]
    assert "console_trusted_proxies" in lines[0] and "'not-an-ip'" in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout
