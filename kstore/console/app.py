"""The console's ASGI application: :func:`app` builds it, for ``kstore console`` or to mount in yours.

Every page starts with :func:`~kstore.console.access.guard`; a refusal becomes a page of its own
(or, for a page that wants a login, a redirect to the login page).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

from kstore.db.migration import check_migrated
from kstore.errors import DatabaseError, NotMigratedError
from kstore.processor import Processor
from kstore.settings import Settings

from . import pages, urls
from .access import LoginNeeded, console_of, guard
from .auth import CSRF_FIELD, MAX_NAME, Refused, check_csrf, client_address, new_session
from .sessions import ServerSessions
from .state import HERE, Console

#: A group's pages, and a dead letter's: any name Kafka allows travels in the path (see :mod:`.urls`).
GROUP = "/groups/{group:kstore_name}"
LETTER = GROUP + "/dead-letters/{letter_id:kstore_row_id}"


def app(settings: Settings, processors: Mapping[str, Processor] | None = None, *, sample: bool = True) -> Starlette:
    """The web console of the database and brokers ``settings`` name, as an ASGI app.

    ``processors`` maps a group to its processor, for replaying that group's dead letters. With
    ``sample``, the app's lifespan runs the lag sampler (``console_sample_interval_s``); a parent
    app that mounts this one runs no lifespan of it: call ``app.state.console.sampler.start()``
    (and ``.close()``) from your own. Raises ConfigurationError if the console can act and no
    login is configured.
    """
    urls.register()
    console = Console(settings, processors or {})
    if not console.read_only:
        _check_migrated(console)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if sample:
            console.sampler.start()
        try:
            yield
        finally:
            console.close()

    routes = [
        Route("/", pages.groups, name="groups"),
        Route("/login", login_page, name="login"),
        Route("/login", login, methods=["POST"], name="login_post"),
        Route("/logout", logout, methods=["POST"], name="logout"),
        Route(GROUP, pages.overview, name="overview"),
        Route(GROUP + "/partitions/{topic:kstore_name}/{partition:kstore_partition}", pages.partition,
              name="partition"),
        Route(GROUP + "/dead-letters", pages.letters, name="letters"),
        Route(GROUP + "/dead-letters/matching/{action}", pages.act_on_matching, methods=["POST"],
              name="letters_matching"),
        Route(LETTER, pages.letter, name="letter"),
        Route(LETTER + "/key", pages.letter_key, name="letter_key"),
        Route(LETTER + "/value", pages.letter_value, name="letter_value"),
        Route(LETTER + "/edit", pages.letter_edit, name="letter_edit"),
        Route(LETTER + "/{action}", pages.act_on_letter, methods=["POST"], name="letter_action"),
        Route(GROUP + "/offsets", pages.offsets, name="offsets"),
        Route(GROUP + "/offsets/plan", pages.plan_reset, methods=["POST"], name="offsets_plan"),
        Route(GROUP + "/offsets/execute", pages.execute_reset, methods=["POST"], name="offsets_execute"),
        Route(GROUP + "/outbox", pages.outbox, name="outbox"),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    key = settings.console_session_key or secrets.token_urlsafe(32)
    web = _Console(
        routes=routes, lifespan=lifespan,
        middleware=[Middleware(ServerSessions, store=console.store, auth=console.auth, key=key,
                               force_secure=settings.console_secure_cookie)],
        exception_handlers={Refused: _refused},
    )
    web.state.console = console
    return web


def _check_migrated(console: Console) -> None:
    """A console that acts keeps its logins in the database: refuse to start on one that lacks the table
    (one clear line), but serve on through an outage (its pages say so)."""
    try:
        check_migrated(console.engine, console.settings)
    except NotMigratedError:
        console.close()
        raise
    except DatabaseError:
        pass


async def login_page(request: Request) -> Response:
    console = console_of(request)
    if console.read_only:
        return RedirectResponse(request.url_for("groups"), status_code=303)
    return console.render(request, "login.html", None, next=request.query_params.get("next", ""),
                          password=console.auth.password_digest is not None)


async def login(request: Request) -> Response:
    console = console_of(request)
    if console.read_only:
        raise Refused(403, "this console is read-only: no login")
    form = await request.form()
    check_csrf(request, form.get(CSRF_FIELD))
    address = client_address(request)
    wait = console.logins.wait_s(address)
    if wait:
        response = console.render(request, "login.html", None, status=429, next=str(form.get("next", "")),
                                  password=console.auth.password_digest is not None,
                                  error=f"too many failed logins from your address: try again in {wait:.0f} s")
        response.headers["Retry-After"] = str(int(wait + 0.999))
        return response
    name = str(form.get("operator", "")).strip()[:MAX_NAME]
    password = str(form.get("password", ""))
    # The digest is compared even without a name, so a missing name takes as long as a wrong password.
    matches = console.auth.password_matches(password)
    if not name or not matches:
        console.logins.failed(address)
        return console.render(request, "login.html", None, status=401, next=str(form.get("next", "")),
                              password=console.auth.password_digest is not None,
                              error="give your name and the console's password")
    new_session(request, name)
    return RedirectResponse(_local(request, str(form.get("next", ""))), status_code=303)


async def logout(request: Request) -> Response:
    await guard(request, action=True)
    request.session.clear()
    return RedirectResponse(request.url_for("login"), status_code=303)


def _local(request: Request, target: str) -> str:
    """Where to go after the login: a path of this console, never another site."""
    root = str(request.url_for("groups"))
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return root


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    console = console_of(request)
    if isinstance(exc, LoginNeeded):
        return RedirectResponse(f"{request.url_for('login')}?{urlencode({'next': urls.here(request)})}",
                                status_code=303)
    return console.render(request, "refused.html", None, status=exc.status, why=exc.why)


class _Console(Starlette):
    """The console's Starlette app, every answer of which carries :data:`SECURITY_HEADERS`: pages,
    refusals, 404s and the 500 of an error nothing caught (which Starlette's outermost layer sends)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await super().__call__(scope, receive, sending)


#: No framing, no scripts or styles but the console's own, nothing cached.
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'; form-action 'self'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]
