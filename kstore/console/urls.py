"""How names and numbers travel in the console's URLs.

Kafka allows any character in a group id (``/``, ``?``, ``#``, ``%``, spaces), so a name is put
into a path segment percent-encoded twice: the server decodes a request's path once before it
routes it (``%2F`` would become a ``/`` and split the segment), and the route decodes it the
second time. Numbers are bounded where the URL is matched: a letter id or partition too large for
the database's integer types is a page that does not exist (404), never a query that fails.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, unquote

from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request

#: The path convertors the console's routes use: ``{group:name}`` and so on.
NAME, ROW_ID, PARTITION = "kstore_name", "kstore_row_id", "kstore_partition"


def segment(name: str) -> str:
    """``name`` as one path segment of a link (what the browser sends; the server decodes it once)."""
    once = quote(name, safe="")
    if once.strip(".") == "":  # "." and ".." are dot-segments a browser would resolve away
        once = once.replace(".", "%2E")
    return quote(once, safe="")


class NameConvertor(Convertor[str]):
    """A group or topic name, any characters; see :func:`segment`."""

    regex = "[^/]+"

    def convert(self, value: str) -> str:
        return unquote(value)

    def to_string(self, value: str) -> str:
        return segment(str(value))


class BoundedIntConvertor(Convertor[int]):
    """A non-negative integer of at most ``digits`` digits (longer ones match no route)."""

    def __init__(self, digits: int) -> None:
        self.regex = f"[0-9]{{1,{digits}}}"  # type: ignore[misc]  # per instance: two bounds, one class

    def convert(self, value: str) -> int:
        return int(value)

    def to_string(self, value: int) -> str:
        return str(int(value))


def register() -> None:
    """Make the console's convertors known to Starlette's routing (idempotent)."""
    register_url_convertor(NAME, NameConvertor())
    # 18 digits always fit a signed 64-bit id; Kafka's partitions are 32-bit.
    register_url_convertor(ROW_ID, BoundedIntConvertor(18))
    register_url_convertor(PARTITION, BoundedIntConvertor(9))


def here(request: Request) -> str:
    """This request's path and query as the browser sent them (encoded), to come back to after a login."""
    raw: Any = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else quote(request.url.path)
    return path + (f"?{request.url.query}" if request.url.query else "")
