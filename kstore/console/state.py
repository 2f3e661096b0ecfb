"""What every page of one console shares: its settings, login rules, processors, lag reader and sampler.

Pages run their database and broker calls on Starlette's thread pool (:meth:`Console.call`), each
with the operator recorded as who acts (:func:`kstore.db.writes.acting_as`). The one
:class:`~kstore.ops.lag.LagReader` is shared by the pages and the sampler under a lock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
from kstore.masking import Masker
from kstore.ops.lag import GroupReading, LagReader
from kstore.processor import Processor
from kstore.schemas import Registry, UnknownSchemaError, WireFormatError
from kstore.schemas.formats import decoded_for_display
from kstore.settings import Settings

from .auth import CSRF_FIELD, Auth, LoginThrottle, Refused, csrf_token
from .sampling import Sampler
from .urls import segment

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
_MASKER = Masker()


@dataclass(frozen=True)
class Shown:
    """A dead letter's key or value as its page shows it: the text, and how it was read when that
    was through its schema (``avro, schema id 7``), or why it could not be."""

    text: str
    decoded: str | None = None
    note: str | None = None


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
        """A letter's key or value for its page: in a registry's wire format (Avro, JSON Schema) and with
        ``schema_registry_url`` set, decoded with the schema it names, as JSON; else its text (or its
        bytes' repr). A registry that does not answer, or an id it does not know, shows the bytes and why."""
        if data is None:
            return Shown("")
        if self.settings.schema_registry_url:
            try:
                if self._registry is None:
                    self._registry = Registry.of(self.settings)
                found = decoded_for_display(self._registry, data)
            except (UnknownSchemaError, WireFormatError, KstoreError) as exc:  # an outage, an extra not installed
                return Shown(_text(data), note=f"not decoded: {self.mask(str(exc))}")
            except Exception as exc:  # the registry's other refusals: the page still shows the bytes
                return Shown(_text(data), note=f"not decoded: {type(exc).__name__}: {self.mask(str(exc))}")
            if found is not None:
                described, value = found
                return Shown(json.dumps(value, indent=2, default=str), decoded=described)
        return Shown(_text(data))

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
        flash = request.session.pop("flash", None) if "session" in request.scope else None
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


def _text(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return repr(data)


def utc(when: datetime | None) -> str:
    """A time as the pages show it: ISO 8601 in UTC, ``Z`` and all, as the filters take it back."""
    if when is None:
        return "-"
    return aware(when).astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def flash(request: Request, kind: str, text: str) -> None:
    request.session["flash"] = {"kind": kind, "text": text}


__all__ = ["Console", "Refused", "Shown", "flash"]
