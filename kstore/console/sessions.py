"""Logins kept on the server, so that logging out ends them.

The browser holds a random token (cookie ``kstore_console``); the database holds the login it
stands for (:mod:`kstore.db.consolesessions`): the operator, the login's CSRF token and the outcome
of the last action, waiting to be shown. Logging out deletes the row, so a copied cookie stops
acting at once, on every console of the database; a console started with another password finds
none of the old logins; each lasts :data:`LIFETIME` at most.

Before a login, the login form's CSRF token is the HMAC of a random value in a second cookie
(``kstore_console_form``) under the console's key: nothing is stored for a visitor who has not
logged in. Pages see all of it as Starlette's ``request.session`` dict.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from datetime import timedelta
from http.cookies import SimpleCookie
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kstore.db.consolesessions import Login, Logins, build_table
from kstore.db.store import Store

from .auth import CSRF, OPERATOR, Auth

#: The login's cookie, and the cookie behind the login form's CSRF token.
COOKIE, FORM_COOKIE = "kstore_console", "kstore_console_form"
#: The session key of the outcomes waiting to be shown, by the id of the action: each page shows its own.
FLASH = "flash"
#: How many outcomes wait at most (an action whose page was never loaded leaves one behind).
KEPT_OUTCOMES = 16
#: How long a login lasts, however active.
LIFETIME = timedelta(hours=12)
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_UNAVAILABLE = PlainTextResponse("the console's database does not answer: try again shortly", status_code=503)


class ServerSessions:
    """ASGI middleware: ``scope["session"]`` from the login row, saved back when a page changed it."""

    def __init__(self, inner: ASGIApp, store: Store, auth: Auth, key: str, force_secure: bool) -> None:
        self.inner, self.auth, self.force_secure = inner, auth, force_secure
        self.logins = Logins(store.engine, build_table(store.settings.table_prefix, store.settings.schema))
        self.key = key.encode()
        # A login made under another password is no login: a new password logs everyone out.
        self.password_check = None if auth.password_digest is None else \
            hmac.new(self.key + b"/password", auth.password_digest, hashlib.sha256).hexdigest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.auth.read_only:
            await self.inner(scope, receive, send)
            return
        cookies = HTTPConnection(scope).cookies
        token = cookies.get(COOKIE) or None
        try:
            login = await run_in_threadpool(self.logins.find, token, self.password_check) if token else None
        except SQLAlchemyError:
            await _UNAVAILABLE(scope, receive, send)
            return
        nonce = cookies.get(FORM_COOKIE, "")
        new_nonce = None if _NONCE.fullmatch(nonce) else secrets.token_urlsafe(24)
        session = self._session(login, new_nonce or nonce)
        secure = self.force_secure or scope.get("scheme") == "https"
        before = {**session, FLASH: dict(session.get(FLASH) or {})}  # pages change the outcomes in place
        scope["session"] = session

        unsaved = False

        async def sending(message: Message) -> None:
            nonlocal unsaved
            if unsaved:  # the page's own answer, replaced by the 503 below
                return
            if message["type"] == "http.response.start":
                try:
                    set_cookies = await run_in_threadpool(self._save, token, login, before, session, secure)
                except SQLAlchemyError:  # the login (or logout) did not happen: say so, not what the page said
                    unsaved = True
                    await _UNAVAILABLE(scope, receive, send)
                    return
                if new_nonce is not None and login is None:
                    set_cookies.append(_cookie(FORM_COOKIE, new_nonce, None, secure))
                message["headers"] = [*message.get("headers", []),
                                      *((b"set-cookie", c.encode("latin-1")) for c in set_cookies)]
            await send(message)

        await self.inner(scope, receive, sending)

    def _session(self, login: Login | None, nonce: str) -> dict[str, Any]:
        if login is None:
            return {CSRF: hmac.new(self.key + b"/form", nonce.encode(), hashlib.sha256).hexdigest()}
        session: dict[str, Any] = {CSRF: login.csrf}
        if login.operator:
            session[OPERATOR] = login.operator
        if login.outcome:
            session[FLASH] = json.loads(login.outcome)
        return session

    def _save(self, token: str | None, login: Login | None, before: dict[str, Any],
              after: dict[str, Any], secure: bool) -> list[str]:
        """Write what the page changed; the Set-Cookie values that follow from it."""
        operator = after.get(OPERATOR) or ""
        outcomes, earlier = after.get(FLASH) or {}, before.get(FLASH) or {}
        if login is not None:
            assert token is not None  # a login is found by its token
            if operator == login.operator and after.get(CSRF) == login.csrf:
                added = {k: v for k, v in outcomes.items() if k not in earlier}
                shown = [k for k in earlier if k not in outcomes]
                if added or shown:
                    self.logins.change_outcomes(token, added, shown, KEPT_OUTCOMES)
                return []
            self.logins.end(token)  # logged out, or logged in anew: the old token acts no more
            if not operator:
                return [_cookie(COOKIE, "", timedelta(0), secure)]
        elif not operator and not outcomes:
            return []
        # A new login, or (logins by a proxy's header) somewhere to keep an action's outcome.
        new = self.logins.create(operator, str(after.get(CSRF) or secrets.token_urlsafe(32)), self.password_check,
                                 LIFETIME, json.dumps(outcomes) if outcomes else None)
        return [_cookie(COOKIE, new, LIFETIME, secure)]


def _cookie(name: str, value: str, lifetime: timedelta | None, secure: bool) -> str:
    """A Set-Cookie value: sent back only to this site, never read by scripts; Secure over HTTPS."""
    cookie: SimpleCookie = SimpleCookie()
    cookie[name] = value
    morsel = cookie[name]
    morsel["path"], morsel["httponly"], morsel["samesite"] = "/", True, "Strict"
    if lifetime is not None:
        morsel["max-age"] = int(lifetime.total_seconds())
    if secure:
        morsel["secure"] = True
    return morsel.OutputString()
