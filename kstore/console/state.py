"""What every page of one console shares: its settings, login rules, processors, lag reader and sampler.

Pages run their database and broker calls on Starlette's thread pool (:meth:`Console.call`), each
with the operator recorded as who acts (:func:`kstore.db.writes.acting_as`). The one
:class:`~kstore.ops.lag.LagReader` is shared by the pages and the sampler under a lock.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from kstore.db.store import Store, make_engine
from kstore.db.writes import acting_as, aware
from kstore.errors import BrokerError, ConfigurationError, KstoreError
from kstore.ops.lag import GroupReading, LagReader
from kstore.ops.masking import Masker
from kstore.processor import Processor
from kstore.schemas import Registry, UnknownSchemaError, WireFormatError
from kstore.schemas.formats import decoded_for_display
from kstore.settings import Settings

from .auth import CSRF_FIELD, Auth, LoginThrottle, Refused, csrf_token
from .sampling import Sampler
from .sessions import FLASH
from .urls import segment

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
_MASKER = Masker()


#: How much of a key, a value or a header's value the letter page shows (characters of its text or
#: its base64): the page stays small whatever the letter holds, and the whole is downloaded.
PREVIEW_CHARS = 4096
#: How a letter's bytes are shown and edited: their UTF-8 text, their base64, or decoded through
#: their schema as JSON (the form's ``encoding`` field says which, so the server reads it back alike).
TEXT, BASE64, SCHEMA_JSON = "text", "base64", "json"
#: Characters a form does not carry back as they are (a textarea sends a line break as CR LF and
#: cannot hold NUL) and other control characters no one sees on a page: text with any is base64.
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: Base64 in lines of MIME's length, so a long value reads (and is edited) as a block.
_BASE64_LINE = 76


@dataclass(frozen=True)
class Shown:
    """A dead letter's key or value (or a header's value, an error) as its pages show it: ``text`` in
    ``encoding`` (see :data:`TEXT`), how it was read when that was through its schema (``decoded``:
    ``avro, schema id 7``) or why it could not be (``note``), and its length in bytes (``size``;
    None for a null key or value). A page shows the first ``limit`` characters (:attr:`preview`)."""

    text: str
    decoded: str | None = None
    note: str | None = None
    encoding: str = TEXT
    size: int | None = None
    limit: int = PREVIEW_CHARS

    @property
    def preview(self) -> str:
        return self.text[:self.limit]

    @property
    def truncated(self) -> bool:
        return len(self.text) > self.limit


class Console:
    """One console: built by :func:`kstore.console.app`, held in ``app.state.console``."""

    def __init__(self, settings: Settings, processors: Mapping[str, Processor]) -> None:
        self.settings = settings
        self.auth = Auth.of(settings)
        self.logins = LoginThrottle()
        self.processors = dict(processors)
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.filters["segment"] = segment
        self.templates.env.filters["utc"] = utc
        self.engine = make_engine(settings)
        self.store = Store(self.engine, settings)
        self._reader: LagReader | None = None
        self._registry: Registry | None = None
        self._reader_lock = threading.Lock()
        self.sampler = Sampler(self.store, self.read_all, settings.console_sample_interval_s,
                               settings.console_sample_retention_s)

    @property
    def read_only(self) -> bool:
        return self.auth.read_only

    def read(self, group: str) -> GroupReading:
        """A group now: partitions, owners, dead letters, outbox (the pages' and the sampler's one reader)."""
        return self._reading(lambda reader: reader.read(group))

    def read_all(self) -> tuple[list[GroupReading], dict[str, BrokerError]]:
        """Every group now, for the sampler: see :meth:`LagReader.read_all`."""
        return self._reading(LagReader.read_all)

    def _reading(self, read: Callable[[LagReader], T]) -> T:
        with self._reader_lock:
            if self._reader is None:
                self._reader = LagReader(self.settings, owners=True, outbox=True)
            try:
                return read(self._reader)
            except Exception:
                self._reader.reset()
                raise

    def shown(self, data: bytes | None) -> Shown:
        """A letter's key or value for its pages: in a registry's wire format (Avro, JSON Schema) and with
        ``schema_registry_url`` set, decoded with the schema it names, as JSON; else as :func:`plain`
        shows it. A registry that does not answer, or an id it does not know, shows the bytes and why."""
        if data is None or not self.settings.schema_registry_url:
            return plain(data)
        try:
            if self._registry is None:
                self._registry = Registry.of(self.settings)
            found = decoded_for_display(self._registry, data)
        except (UnknownSchemaError, WireFormatError, KstoreError) as exc:  # an outage, an extra not installed
            return replace(plain(data), note=f"not decoded: {self.mask(str(exc))}")
        except Exception as exc:  # the registry's other refusals: the page still shows the bytes
            return replace(plain(data), note=f"not decoded: {type(exc).__name__}: {self.mask(str(exc))}")
        if found is None:
            return plain(data)
        described, value = found
        return Shown(json.dumps(value, indent=2, default=str), decoded=described, encoding=SCHEMA_JSON,
                     size=len(data))

    def processor(self, group: str) -> Processor:
        found = self.processors.get(group)
        if found is None:
            known = ", ".join(sorted(self.processors)) or "none"
            raise ConfigurationError(f"replaying runs the group's processor, and this console has none for {group!r} "
                                     f"(start it with --processor MODULE:CLASS; it has: {known})")
        return found

    async def call(self, operator: str | None, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread pool, its writes recorded as ``operator``'s."""
        def acting() -> T:
            if operator is None:
                return fn()
            with acting_as(operator):
                return fn()
        return await run_in_threadpool(acting)

    def mask(self, text: str) -> str:
        """``text`` with what stands in a credential's place (a URL's password, a ``password=`` value)
        shown as ``***``. By structure alone, never by comparing with the settings' secrets: text shown
        to a visitor may hold what they sent, and masking their guess would say it was right."""
        return _MASKER.mask(text)

    def render(self, request: Request, name: str, operator: str | None, status: int = 200,
               **context: Any) -> Response:
        # The outcome of the action that led here: its own, by the id in the URL, whatever else was done meanwhile.
        outcomes = request.session.get(FLASH) if "session" in request.scope else None
        key = request.query_params.get("outcome")
        flash = outcomes.pop(key, None) if key and isinstance(outcomes, dict) else None
        response: Response = self.templates.TemplateResponse(request, name, {
            "operator": operator, "read_only": self.read_only, "csrf_field": CSRF_FIELD,
            "csrf": csrf_token(request) if "session" in request.scope else "", "flash": flash,
            # Which database this is, for operators only: the login page shows it to no one.
            "database": self.settings.safe_dsn if operator is not None or self.read_only else None,
            **context,
        }, status_code=status)
        return response

    def close(self) -> None:
        self.sampler.stop()
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
        self.engine.dispose()


def plain(data: bytes | None, limit: int = PREVIEW_CHARS) -> Shown:
    """``data`` as its UTF-8 text where a form carries that back byte for byte, else as base64."""
    if data is None:
        return Shown("", limit=limit)
    text, encoding = _text(data)
    return Shown(text, encoding=encoding, size=len(data), limit=limit)


def _text(data: bytes) -> tuple[str, str]:
    """``data``'s text and :data:`TEXT`, if it is UTF-8 without a character a form would change;
    else its base64, in lines, and :data:`BASE64`."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = None
    if text is not None and not _UNSAFE.search(text):
        return text, TEXT
    encoded = base64.b64encode(data).decode()
    return "\n".join(encoded[i:i + _BASE64_LINE] for i in range(0, len(encoded), _BASE64_LINE)), BASE64


def utc(when: datetime | None) -> str:
    """A time as the pages show it: ISO 8601 in UTC, ``Z`` and all, as the filters take it back."""
    if when is None:
        return "-"
    return aware(when).astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def flash(request: Request, kind: str, text: str) -> dict[str, str]:
    """Keep an action's outcome for the page it redirects to; the query to ask that page with."""
    key = secrets.token_urlsafe(9)
    request.session.setdefault(FLASH, {})[key] = {"kind": kind, "text": text}
    return {"outcome": key}


__all__ = ["Console", "Refused", "Shown", "flash"]
