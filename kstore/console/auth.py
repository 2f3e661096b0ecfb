"""Who may use the console, and proof that an action came from its own pages.

- **Login.** Unless the console is read-only, every page asks for an operator: either the name a
  trusted proxy put in ``console_user_header``, or a name and ``console_password`` given on the
  login page (compared by their SHA-256 digests, in constant time). The operator's name goes into
  the login kept on the server (:mod:`~kstore.console.sessions`), and into every history row an
  action writes (:func:`kstore.db.writes.acting_as`).
- **CSRF.** The session holds a random token; every form carries it, and a POST whose token does
  not match the session's is refused (403) before anything is read from the database. The cookies
  are ``SameSite=Strict`` as well.
- **Read-only.** No login; the pages hide their forms and every POST is refused (403).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

from limits import RateLimitItem, parse, storage, strategies
from starlette.requests import Request

from kstore.errors import ConfigurationError
from kstore.settings import Settings

#: The session's keys.
OPERATOR = "operator"
CSRF = "csrf"
#: The form field that carries the CSRF token.
CSRF_FIELD = "csrf_token"
#: Longest operator name kept (the histories' ``by_user`` column holds 255).
MAX_NAME = 100
#: The shortest console password taken: the login throttle slows guessing, it cannot make a short
#: password safe.
MIN_PASSWORD = 12


class Refused(Exception):
    """A request the console refuses: ``status`` (401, 403) and why, shown to the person."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


@dataclass(frozen=True)
class Auth:
    """How the console checks who is there (from :class:`~kstore.settings.Settings`)."""

    read_only: bool
    #: SHA-256 of the password, or None (no password login).
    password_digest: bytes | None
    user_header: str | None

    @classmethod
    def of(cls, settings: Settings) -> Auth:
        password = settings.console_password
        if password and len(password) < MIN_PASSWORD:
            raise ConfigurationError(f"console_password is {len(password)} characters: give at least {MIN_PASSWORD} "
                                     "(a long random one, from a file: --password-file)")
        digest = None if not password else _digest(password)
        header = (settings.console_user_header or "").strip() or None
        if not settings.console_read_only and digest is None and header is None:
            raise ConfigurationError(
                "the console acts on pipelines, so it needs a login: give console_password (or "
                "KSTORE_CONSOLE_PASSWORD_FILE, --password-file) or console_user_header (a trusted proxy's), "
                "or start it read-only (--read-only)")
        return cls(settings.console_read_only, digest, header)

    def operator(self, request: Request) -> str | None:
        """The operator of this request: the proxy's header, else the logged-in session's; None if neither."""
        if self.user_header is not None:
            named = request.headers.get(self.user_header, "").strip()
            if named:
                return named[:MAX_NAME]
            if self.password_digest is None:
                return None
        found = request.session.get(OPERATOR)
        return found if isinstance(found, str) and found else None

    def password_matches(self, given: str) -> bool:
        if self.password_digest is None:
            return False
        return hmac.compare_digest(_digest(given), self.password_digest)


#: Failed logins allowed from one address in a moving window; more are refused (429) until the oldest
#: leaves it, whatever the password: a guesser gets five tries in five minutes, an operator who
#: mistyped waits at most that long.
FAILED_LOGINS = "5 per 5 minutes"


@dataclass
class LoginThrottle:
    """Counts failed logins by client address (in this process: one console, one count)."""

    limit: str = FAILED_LOGINS
    _item: RateLimitItem = field(init=False, repr=False)
    _window: strategies.MovingWindowRateLimiter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._item = parse(self.limit)
        self._window = strategies.MovingWindowRateLimiter(storage.MemoryStorage())

    def wait_s(self, address: str) -> float:
        """0 if ``address`` may try to log in now; else the seconds until it may."""
        if self._window.test(self._item, "login", address):
            return 0.0
        reset = self._window.get_window_stats(self._item, "login", address).reset_time
        return max(1.0, reset - time.time())

    def failed(self, address: str) -> None:
        self._window.hit(self._item, "login", address)


def client_address(request: Request) -> str:
    """The address a request came from: the client's own, or behind a trusted proxy
    (``console_trusted_proxies``) the one that proxy names; any other proxy's users share its address."""
    return request.client.host if request.client is not None else "unknown"


def csrf_token(request: Request) -> str:
    """The session's CSRF token, made on first use."""
    token = request.session.get(CSRF)
    if not isinstance(token, str) or not token:
        token = secrets.token_urlsafe(32)
        request.session[CSRF] = token
    return token


def check_csrf(request: Request, given: object) -> None:
    """Refuse (403) a form whose token is not the session's."""
    expected = request.session.get(CSRF)
    if not isinstance(expected, str) or not expected or not isinstance(given, str) \
            or not hmac.compare_digest(given.encode(), expected.encode()):
        raise Refused(403, "this form is out of date or did not come from this console (CSRF token mismatch): "
                           "reload the page and try again")


def new_session(request: Request, operator: str) -> None:
    """After a login: a fresh session (and CSRF token) for ``operator``."""
    request.session.clear()
    request.session[OPERATOR] = operator[:MAX_NAME]
    csrf_token(request)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()
