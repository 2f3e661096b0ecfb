"""Each request's first step: who the operator is, and for an action, whether it may be taken at all.

:func:`guard` refuses a read-only console's actions, an action without an operator and a form
without the session's CSRF token, before any page code runs.
"""

from __future__ import annotations

from starlette.datastructures import FormData
from starlette.requests import Request

from .auth import CSRF_FIELD, Refused, check_csrf
from .state import Console


def console_of(request: Request) -> Console:
    found: Console = request.app.state.console
    return found


async def guard(request: Request, *, action: bool = False,
                max_part_size: int = 1024 * 1024) -> tuple[str | None, FormData | None]:
    """The operator (None on a read-only console), and for an action its checked form, whose fields
    may be up to ``max_part_size`` bytes each as sent (Starlette's default: a megabyte).

    A page without an operator redirects to the login page (:class:`LoginNeeded`); an action
    without one is refused (401), on a read-only console refused (403), and without the session's
    CSRF token refused (403).
    """
    console = console_of(request)
    if action and console.read_only:
        raise Refused(403, "this console is read-only: it takes no action")
    operator = None if console.read_only else console.auth.operator(request)
    if not console.read_only and operator is None:
        if action:
            raise Refused(401, "log in first: no action is taken without an operator's name")
        raise LoginNeeded()
    form = None
    if action:
        form = await request.form(max_part_size=max_part_size)
        check_csrf(request, form.get(CSRF_FIELD))
    return operator, form


class LoginNeeded(Refused):
    """A page asked for without a login: the console redirects to the login page."""

    def __init__(self) -> None:
        super().__init__(401, "log in first")
