"""psycopg2's own SQL literals for the commonest values, written without the adapter machinery.

The multi-row INSERTs of :mod:`kstore.db.manyrows` quote every row with
``cursor.mogrify(template, row)``, as ``psycopg2.extras.execute_values`` does. For each value
that builds an adapter object and calls its ``getquoted()``: about 1.5 µs per value, most of
a deferred INSERT's CPU. For the values almost every row is made of, psycopg2's literal is a
plain function of the value, and this module writes exactly it:

- ``None``: ``NULL`` (psycopg2's ``NoneAdapter``);
- ``bool``: ``true`` or ``false`` (``Boolean``);
- ``int``: ``str(v)``, `` -5`` for a negative one (``Int``);
- ``float``: ``repr(v)``, with the same space before a minus; ``'NaN'::float``,
  ``'Infinity'::float``, ``'-Infinity'::float`` (``Float``);
- ``str`` of ASCII characters without NUL: ``'...'`` with its quotes doubled (``QuotedString``);
- ``bytes``: ``'\\x<hex>'::bytea`` (``Binary``).

Each by the value's exact type: a subclass (an ``IntEnum``, a ``str`` subclass) is not this module's.

(The leading space of a negative number is psycopg2's: ``-%s`` must not become ``--5``, a comment.)

Only where psycopg2 would write the same, which :func:`stock_quoting` checks for each batch:
the connection's ``standard_conforming_strings`` is ``on`` (so a backslash is itself, and
``'\\x...'`` is read as psycopg2 means it) and the adapters of these types are psycopg2's own
(``register_adapter`` can replace them). Any other value (a subclass such as an ``IntEnum``, a
``Decimal``, a date, a non-ASCII string, a string with NUL, which psycopg2 refuses) makes its
row go through ``mogrify``. tests/test_literals.py holds every literal here to
psycopg2's own, byte for byte, on generated values, and the differential tests
(tests/test_differential.py) the rows written to the plain path's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

#: A value's literal, or None: this module does not write it (its row takes ``mogrify``).
Literal = Callable[[Any], "str | None"]


def _none(_value: None) -> str:
    return "NULL"


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _int(value: int) -> str:
    return str(value) if value >= 0 else " " + str(value)


def _float(value: float) -> str:
    if math.isfinite(value):
        text = repr(value)
        return " " + text if text[0] == "-" else text
    if math.isnan(value):
        return "'NaN'::float"
    return "'Infinity'::float" if value > 0 else "'-Infinity'::float"


def _str(value: str) -> str | None:
    if not value.isascii() or "\x00" in value:
        return None
    return "'" + value.replace("'", "''") + "'"


def _bytes(value: bytes) -> str:
    return "'\\x" + value.hex() + "'::bytea"


_LITERALS: dict[type, Literal] = {
    type(None): _none, bool: _bool, int: _int, float: _float, str: _str, bytes: _bytes,
}


def literal(value: Any) -> str | None:
    """psycopg2's literal of ``value`` on a connection :func:`stock_quoting` accepts, or None."""
    write = _LITERALS.get(type(value))
    return None if write is None else write(value)


def stock_quoting(dbapi_connection: Any) -> bool:
    """True if psycopg2 quotes these types on ``dbapi_connection`` as this module does: strings
    read as written (``standard_conforming_strings``, which a ``SET`` may turn off, as libpq
    reports) and psycopg2's own adapters registered for them."""
    import psycopg2.extensions as ext

    if dbapi_connection.get_parameter_status("standard_conforming_strings") != "on":
        return False
    stock = {type(None): ext.NoneAdapter, bool: ext.Boolean, int: ext.Int, float: ext.Float,
             str: ext.QuotedString, bytes: ext.Binary}
    adapters = ext.adapters
    return all(adapters.get((kind, ext.ISQLQuote)) is adapter for kind, adapter in stock.items())


#: A named placeholder of a psycopg2 template, or a doubled (literal) percent sign.
_PLACEHOLDER = re.compile(r"%\(([^)]*)\)s|%%")


class RowFormat:
    """One row's template (``(%(a)s, %(b)s::JSONB, 'x')``) as a Python format string and the
    parameter names in the order they appear: a row's literals are put in as psycopg2's
    ``mogrify`` would put its quoted values."""

    __slots__ = ("format", "names")

    def __init__(self, format_: str, names: tuple[str, ...]) -> None:
        self.format = format_
        self.names = names

    @classmethod
    def of(cls, template: str) -> RowFormat | None:
        """The template's format, or None if it has a percent sign psycopg2 would read otherwise."""
        if "%" in _PLACEHOLDER.sub("", template):
            return None  # a lone percent sign: psycopg2's own error, from mogrify
        names: list[str] = []
        pieces: list[str] = []
        at = 0
        for match in _PLACEHOLDER.finditer(template):
            pieces.append(_braces(template[at:match.start()]))
            if match.group(0) == "%%":
                pieces.append("%")
            else:
                names.append(match.group(1))
                pieces.append("{}")
            at = match.end()
        pieces.append(_braces(template[at:]))
        return cls("".join(pieces), tuple(names))

    def row(self, values: dict[str, Any]) -> str | None:
        """The row with every value's literal put in, or None if one value is not this module's."""
        literals = []
        for name in self.names:
            value = values[name]
            write = _LITERALS.get(type(value))
            text = None if write is None else write(value)
            if text is None:
                return None
            literals.append(text)
        return self.format.format(*literals)


def _braces(text: str) -> str:
    """``text`` as literal text of a Python format string."""
    return text.replace("{", "{{").replace("}", "}}")
