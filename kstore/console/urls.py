"""How names and numbers travel in the console's URLs.

Kafka allows any character in a group id (``/``, ``?``, ``#``, ``%``, spaces), so a name is put
into its path segment with every character but letters, digits, ``.``, ``_`` and ``-`` written as
``~`` and the hex of its UTF-8 bytes (``a/b`` is ``a~2Fb``). Percent-encoding would not do: servers,
proxies and test clients decode a path before routing it, some more than once, and ``%2F`` becomes
a ``/`` that splits the segment; ``~`` means nothing to any of them. Numbers are bounded where the
URL is matched: a letter id or partition too large for the database's integer types is a page that
does not exist (404), never a query that fails.
"""

from __future__ import annotations

import re

from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request

#: The path convertors the console's routes use: ``{group:kstore_name}`` and so on.
NAME, ROW_ID, PARTITION = "kstore_name", "kstore_row_id", "kstore_partition"
_KEPT = re.compile(r"[A-Za-z0-9_-]")  # "." too, but not a name of dots alone: "." and ".." are dot-segments
_ESCAPED = re.compile(r"~([0-9A-F]{2})")


def segment(name: str) -> str:
    """``name`` as one path segment of a link."""
    dots_only = name.strip(".") == ""
    return "".join(c if _KEPT.match(c) or (c == "." and not dots_only) else
                   "".join(f"~{b:02X}" for b in c.encode()) for c in name)


def _unescape(text: str) -> str:
    out, pos = bytearray(), 0
    for found in _ESCAPED.finditer(text):
        out += text[pos:found.start()].encode() + bytes([int(found.group(1), 16)])
        pos = found.end()
    out += text[pos:].encode()
    return out.decode(errors="replace")


class NameConvertor(Convertor[str]):
    """A group or topic name, any characters; see :func:`segment`."""

    regex = r"(?:[A-Za-z0-9._-]|~[0-9A-F]{2})+"

    def convert(self, value: str) -> str:
        return _unescape(value)

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
    """This request's path and query, to come back to after a login."""
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")
