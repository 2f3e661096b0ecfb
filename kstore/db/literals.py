"""The drivers' own SQL literals for the commonest values, written without their adapter machinery.

The multi-row INSERTs of :mod:`kstore.db.manyrows` quote every row on the client, as
``psycopg2.extras.execute_values`` does: psycopg2's ``cursor.mogrify(template, row)``, psycopg 3's
``ClientCursor.mogrify``. For each value that builds or looks up an adapter and calls it: about
1.5 µs per value on psycopg2, about 3 µs on psycopg 3, most of a deferred INSERT's CPU. For the
values almost every row is made of, the driver's literal is a plain function of the value, and
this module writes exactly it:

- ``None``: ``NULL``;
- ``bool``: ``true`` or ``false``;
- ``int``: ``str(v)``, `` -5`` for a negative one;
- ``float``: ``repr(v)``, with the same space before a minus; NaN and the infinities quoted and
  cast: ``'NaN'::float`` on psycopg2, ``'NaN'::float8`` on psycopg 3;
- ``str`` of ASCII characters without NUL: ``'...'`` with its quotes doubled; on psycopg 3 (libpq's
  ``PQescapeLiteral``) one with a backslash is `` E'...'`` with its backslashes doubled too;
- ``bytes``: ``'\\x<hex>'::bytea``.

Each by the value's exact type: a subclass (an ``IntEnum``, a ``str`` subclass) is not this module's.

(The leading space of a negative number is the drivers': ``-%s`` must not become ``--5``, a comment.)

Only where the driver would write the same, which :func:`stock_quoting` checks for each batch:
the connection's ``standard_conforming_strings`` is ``on`` (so a backslash is itself, and
``'\\x...'`` is read as the driver means it) and the adapters of these types are the driver's own
(psycopg2's ``register_adapter`` and psycopg 3's ``adapters.register_dumper`` can replace them;
psycopg 3's C and pure-Python dumpers write the same). Any other value (a
subclass such as an ``IntEnum``, a ``Decimal``, a date, a non-ASCII string, a string with NUL,
which both drivers refuse) makes its row go through ``mogrify``. tests/integration/database/test_literals.py holds
every literal here to the driver's own, byte for byte, on generated values, and the differential
tests (tests/integration/database/test_differential.py) the rows written to the plain path's.
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


def _float_as(cast: str) -> Literal:
    nan, infinity, minus_infinity = (f"'{word}'::{cast}" for word in ("NaN", "Infinity", "-Infinity"))

    def write(value: float) -> str:
        if math.isfinite(value):
            text = repr(value)
            return " " + text if text[0] == "-" else text
        if math.isnan(value):
            return nan
        return infinity if value > 0 else minus_infinity

    return write


def _str(value: str) -> str | None:
    if not value.isascii() or "\x00" in value:
        return None
    return "'" + value.replace("'", "''") + "'"


def _str_escaped(value: str) -> str | None:
    """libpq's ``PQescapeLiteral``, as psycopg 3 quotes text: an escape string where a backslash is."""
    text = _str(value)
    if text is None or "\\" not in value:
        return text
    return " E" + text.replace("\\", "\\\\")


def _bytes(value: bytes) -> str:
    return "'\\x" + value.hex() + "'::bytea"


_PSYCOPG2: dict[type, Literal] = {
    type(None): _none, bool: _bool, int: _int, float: _float_as("float"), str: _str, bytes: _bytes,
}
#: Each driver's literals, by SQLAlchemy's name of the driver: psycopg 3's differ in two.
LITERALS: dict[str, dict[type, Literal]] = {
    "psycopg2": _PSYCOPG2,
    "psycopg": {**_PSYCOPG2, float: _float_as("float8"), str: _str_escaped},
}


def literal(value: Any, driver: str) -> str | None:
    """The driver's literal of ``value`` on a connection :func:`stock_quoting` accepts, or None."""
    write = LITERALS[driver].get(type(value))
    return None if write is None else write(value)


def stock_quoting(dbapi_connection: Any, driver: str) -> bool:
    """True if the driver quotes these types on ``dbapi_connection`` as this module does: strings
    read as written (``standard_conforming_strings``, which a ``SET`` may turn off, as libpq
    reports) and the driver's own adapters registered for them."""
    return (_psycopg_stock if driver == "psycopg" else _psycopg2_stock)(dbapi_connection)


def _psycopg2_stock(dbapi_connection: Any) -> bool:
    import psycopg2.extensions as ext

    if dbapi_connection.get_parameter_status("standard_conforming_strings") != "on":
        return False
    stock = {type(None): ext.NoneAdapter, bool: ext.Boolean, int: ext.Int, float: ext.Float,
             str: ext.QuotedString, bytes: ext.Binary}
    adapters = ext.adapters
    return all(adapters.get((kind, ext.ISQLQuote)) is adapter for kind, adapter in stock.items())


#: psycopg 3's text dumpers of these types (``ClientCursor`` writes ``NULL`` for None without one):
#: their pure-Python module and name; its C implementation's have the same name in its own module.
#: A user's ``register_dumper`` replaces them.
_PSYCOPG_DUMPERS = {bool: ("psycopg.types.bool", "BoolDumper"), int: ("psycopg.types.numeric", "IntDumper"),
                    float: ("psycopg.types.numeric", "FloatDumper"),
                    str: ("psycopg.types.string", "StrDumperUnknown"), bytes: ("psycopg.types.string", "BytesDumper")}
_PSYCOPG_C_MODULES = frozenset({"psycopg_binary._psycopg", "psycopg_c._psycopg"})


def _psycopg_stock(dbapi_connection: Any) -> bool:
    from psycopg import ProgrammingError
    from psycopg.adapt import PyFormat

    if dbapi_connection.info.parameter_status("standard_conforming_strings") != "on":
        return False
    adapters = dbapi_connection.adapters
    for kind, (module, name) in _PSYCOPG_DUMPERS.items():
        try:
            dumper = adapters.get_dumper(kind, PyFormat.TEXT)
        except ProgrammingError:
            return False
        if dumper.__name__ != name or (dumper.__module__ != module and dumper.__module__ not in _PSYCOPG_C_MODULES):
            return False
    return True


#: A named placeholder of a template (psycopg2's and psycopg 3's), or a doubled (literal) percent sign.
_PLACEHOLDER = re.compile(r"%\(([^)]*)\)s|%%")


class RowFormat:
    """One row's template (``(%(a)s, %(b)s::JSONB, 'x')``) as a Python format string and the
    parameter names in the order they appear: a row's literals are put in as the driver's
    ``mogrify`` would put its quoted values."""

    __slots__ = ("format", "literals", "names")

    def __init__(self, format_: str, names: tuple[str, ...], driver: str) -> None:
        self.format = format_
        self.names = names
        self.literals = LITERALS[driver]

    @classmethod
    def of(cls, template: str, driver: str) -> RowFormat | None:
        """The template's format, or None if it has a percent sign the driver would read otherwise
        (``%s``, psycopg 3's ``%(a)b``, a lone one)."""
        if "%" in _PLACEHOLDER.sub("", template):
            return None  # a lone percent sign: the driver's own error, from mogrify
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
        return cls("".join(pieces), tuple(names), driver)

    def row(self, values: dict[str, Any]) -> str | None:
        """The row with every value's literal put in, or None if one value is not this module's."""
        literals = []
        table = self.literals
        for name in self.names:
            value = values[name]
            write = table.get(type(value))
            text = None if write is None else write(value)
            if text is None:
                return None
            literals.append(text)
        return self.format.format(*literals)


def _braces(text: str) -> str:
    """``text`` as literal text of a Python format string."""
    return text.replace("{", "{{").replace("}", "}}")
