"""``session.copy_rows``: rows written with PostgreSQL's ``COPY ... FROM STDIN``, in the batch's transaction.

COPY is PostgreSQL's bulk path: one statement streams every row, and the server
parses them without planning an INSERT per page of rows. Inside the batch's
transaction it is as exactly-once as any other write: the rows and the offsets
commit together, or neither does.

- psycopg2, and psycopg 3 for the value types listed in :func:`_text_field`: the rows are
  written here in COPY's text format (tab-separated, ``\\N`` for NULL, backslash escapes),
  checked whole, then encoded and sent a piece at a time, so the server parses one piece
  while the next is encoded (``copy_expert``; psycopg 3's ``cursor.copy()``).
- psycopg 3, for any other type: the driver's ``write_row`` adapts each value.
- SQLite (no COPY): the same rows as one multi-row INSERT, so a processor runs
  unchanged on the embedded default.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import date, datetime, time, timedelta, tzinfo
from decimal import Decimal
from functools import partial
from itertools import repeat
from operator import itemgetter
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import Connection, Table, column, insert
from sqlalchemy import table as table_clause
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import JSON, DateTime, TypeDecorator

from kstore.errors import WriteCountError

from .manyrows import COUNT_HINT, connection_encoding

# COPY's text format: backslash, tab, newline and carriage return are escaped.
_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _bytes(value: bytes | bytearray | memoryview) -> str:
    # bytea's hex input, \x..., with its backslash escaped for COPY.
    return "\\\\x" + bytes(value).hex()


def _str(value: str) -> str:
    return value.translate(_ESCAPES)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")).translate(_ESCAPES)


_JSON = (dict, list)

_FORMATS: dict[type, Callable[[Any], str]] = {
    bytes: _bytes, bytearray: _bytes, memoryview: _bytes,
    str: _str,
    int: int.__repr__, float: float.__repr__, Decimal: str,
    bool: lambda v: "t" if v else "f",
    datetime: datetime.isoformat, date: date.isoformat, time: time.isoformat,
    timedelta: lambda v: f"{v.days} days {v.seconds} seconds {v.microseconds} microseconds",
    uuid.UUID: str,
    dict: _json, list: _json,
}


def _text_field(value: Any) -> str:
    """One value in COPY's text format; ``\\N`` for None."""
    if value is None:
        return "\\N"
    fmt = _FORMATS.get(type(value))
    if fmt is None:
        for kind, candidate in _FORMATS.items():  # subclasses (IntEnum, a str subclass...)
            if isinstance(value, kind):
                fmt = candidate
                break
        else:
            raise TypeError(
                f"copy_rows cannot write a {type(value).__name__} value with psycopg2: use None, bool, int, "
                "float, Decimal, str, bytes, date, time, datetime, timedelta, UUID, or dict/list (as JSON); "
                "or session.execute(insert(table), rows)"
            )
    return fmt(value)


#: Whole columns of one type, formatted by C loops (map over a method), no Python call per value.
_COLUMN_FORMATS: dict[type, Callable[[list[Any]], Iterable[str]]] = {
    int: lambda col: map(int.__repr__, col),
    str: lambda col: map(str.translate, col, repeat(_ESCAPES)),
    bytes: lambda col: map("\\\\x".__add__, map(bytes.hex, col)),
}

#: Rows encoded at a time while a COPY is sent: the server parses one piece while kstore encodes
#: the next, where encoding the whole batch first left the server idle meanwhile.
COPY_PIECE_ROWS = 500


def _text_column(col: list[Any], encoding: str) -> Callable[[slice], Iterable[str]]:
    """A column's values in COPY's text format, a slice of rows at a time: by a C loop when they
    are all of one common type. Whatever can fail is found here, before a byte is sent (a COPY
    that fails midway leaves the transaction aborted): a type COPY cannot take (TypeError), a
    NUL in a text value (ValueError, as psycopg2 refuses it in an INSERT; the server would refuse
    it in a COPY, with another error than the INSERT's), a character the connection's encoding
    lacks (UnicodeEncodeError). Bytes go as hex, numbers and JSON hold no NUL."""
    kinds = set(map(type, col))
    kind = kinds.pop() if len(kinds) == 1 else None
    fast = _COLUMN_FORMATS.get(kind) if kind is not None else None
    if fast is None:
        col, fast, kind = list(map(_text_field, col)), list, str
    if kind is str:
        text = "".join(col)
        if "\x00" in text:
            raise ValueError("A string literal cannot contain NUL (0x00) characters.")
        if not text.isascii():
            text.encode(encoding)
    return lambda rows: fast(col[rows])


def _text_pieces(rows: Sequence[Sequence[Any]], encoding: str) -> Iterator[bytes]:
    """The rows in COPY's text format, built column by column and encoded for the connection,
    :data:`COPY_PIECE_ROWS` rows a piece. Every value is checked before the first piece (see
    :func:`_text_column`): only what is sent is left to the iterator."""
    columns = [_text_column(list(col), encoding) for col in zip(*rows, strict=True)]

    def pieces() -> Iterator[bytes]:
        for start in range(0, len(rows), COPY_PIECE_ROWS):
            part = slice(start, start + COPY_PIECE_ROWS)
            lines = list(map("\t".join, zip(*(column(part) for column in columns), strict=True)))
            lines.append("")
            yield "\n".join(lines).encode(encoding)

    return pieces()


class _PieceReader:
    """The file psycopg2's ``copy_expert`` reads: each ``read()`` is the next piece, encoded then."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces

    def read(self, _size: int) -> bytes:
        return next(self._pieces, b"")


def copy_rows(
    conn: Connection, target: Table | str, rows: Sequence[Mapping[str, Any] | Sequence[Any]],
    columns: Sequence[str] | None, *, schema: str | None = None,
) -> int:
    """Write ``rows`` into ``target`` on ``conn`` (inside its transaction); returns how many."""
    if not rows:
        return 0
    names, values = _columns_and_values(target, rows, columns)
    if isinstance(target, Table):
        values = _bind_decorated(target, names, values, conn)
    dialect = conn.dialect
    if dialect.name != "postgresql":
        t = target if isinstance(target, Table) else table_clause(target, *map(column, names), schema=schema)
        conn.execute(insert(t), [dict(zip(names, row, strict=True)) for row in values])
        return len(values)
    q = dialect.identifier_preparer
    name = q.format_table(target) if isinstance(target, Table) else (
        f"{q.quote_schema(schema)}.{q.quote(target)}" if schema else q.quote(target))
    sql = f"COPY {name} ({', '.join(map(q.quote, names))}) FROM STDIN"
    dbapi: Any = conn.connection.dbapi_connection
    try:
        if dialect.driver == "psycopg":
            copied = _psycopg_copy(dbapi, sql, values, connection_encoding(conn))
        else:
            data = _PieceReader(_text_pieces(values, connection_encoding(conn)))
            with dbapi.cursor() as cur:
                cur.copy_expert(sql, data)
                copied = cur.rowcount
    except dialect.loaded_dbapi.Error as exc:
        # As SQLAlchemy itself would raise it (IntegrityError, OperationalError...), and a
        # lost connection invalidated, so kstore tells an outage from a bad row as for any write.
        lost = dialect.is_disconnect(exc, dbapi, None)
        if lost:
            conn.invalidate(exc)
        raise DBAPIError.instance(sql, None, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost,
                                  dialect=dialect) from exc
    if copied != len(values):
        # The server's own count ("COPY n"): a row lost in kstore's encoding (an unescaped newline
        # splits one, an escaped one joins two) or dropped by the table must not pass unnoticed.
        raise WriteCountError(f"a COPY of {len(values)} rows into {name} reported {copied} rows written: "
                              f"the batch fails and nothing of it commits. {COUNT_HINT}")
    return len(values)


def _psycopg_copy(dbapi: Any, sql: str, values: Sequence[Sequence[Any]], encoding: str) -> int:
    """psycopg 3: kstore's text encoding when it knows every value's type (whole columns by C
    loops, faster than a ``write_row`` per row); otherwise psycopg's own adaptation, row by row."""
    try:
        pieces: Iterator[bytes] | None = _text_pieces(values, encoding)
    except UnicodeEncodeError:  # (a ValueError, but not a NUL)
        raise
    except ValueError:  # a NUL in a text value: psycopg 3's own error for it in an INSERT
        import psycopg

        raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes") from None
    except TypeError:
        pieces = None
        if any(type(v) in _JSON for row in values for v in row):
            values = [[json.dumps(v) if type(v) in _JSON else v for v in row] for row in values]
    with dbapi.cursor() as cur:
        with cur.copy(sql) as copy:
            if pieces is not None:
                for piece in pieces:
                    copy.write(piece)
            else:
                write = copy.write_row
                for row in values:
                    write(row)
        return int(cur.rowcount)


def _columns_and_values(
    target: Table | str, rows: Sequence[Mapping[str, Any] | Sequence[Any]], columns: Sequence[str] | None,
) -> tuple[list[str], Sequence[Sequence[Any]]]:
    """The column names and each row's values in their order."""
    first = rows[0]
    if isinstance(first, Mapping):
        names = list(columns) if columns is not None else list(first.keys())
        get = itemgetter(*names)
        checked = _checked(rows, len(names), names)  # type: ignore[arg-type]
        if len(names) == 1:
            return names, [(get(r),) for r in checked]
        return names, list(map(get, checked))
    if columns is not None:
        names = list(columns)
    elif isinstance(target, Table):
        names = [c.name for c in target.columns]
    else:
        raise TypeError("copy_rows(name, rows): give columns=[...] for rows that are tuples")
    values: Sequence[Sequence[Any]] = rows  # type: ignore[assignment]
    for row in values:
        if len(row) != len(names):
            raise ValueError(f"copy_rows: a row has {len(row)} values for {len(names)} columns {names}")
    return names, values


def _checked(rows: Sequence[Mapping[str, Any]], n: int, names: list[str]) -> Sequence[Mapping[str, Any]]:
    for row in rows:
        if len(row) != n:
            raise ValueError(f"copy_rows: a row has keys {sorted(row)}, the first row {sorted(names)}")
    return rows


def _bind_decorated(target: Table, names: list[str], values: Sequence[Sequence[Any]],
                    conn: Connection) -> Sequence[Sequence[Any]]:
    """Apply the columns' TypeDecorators (a user's own types) to their values, as an INSERT would;
    and write a JSON column's values as an INSERT does: every value as JSON text, None as JSON
    ``null`` (SQL NULL with ``none_as_null=True``), so ``False`` is ``false``, not COPY's ``f``."""
    dialect = conn.dialect
    convert: dict[int, Callable[[Any], Any]] = {}
    for i, name in enumerate(names):
        kind = target.c[name].type
        if isinstance(kind, TypeDecorator) and type(kind).process_bind_param is not TypeDecorator.process_bind_param:
            convert[i] = partial(kind.process_bind_param, dialect=dialect)
        elif isinstance(kind, DateTime) and not kind.timezone and dialect.name == "postgresql":
            # COPY into a timestamp ignores an offset; an INSERT converts to the session's time zone.
            convert[i] = partial(_naive_in, _session_zone(conn))
        elif isinstance(kind, JSON) and dialect.name == "postgresql":
            convert[i] = partial(_json_text, getattr(dialect, "_json_serializer", None) or json.dumps,
                                 kind.none_as_null)
    if not convert:
        return values
    return [[convert[i](v) if i in convert else v for i, v in enumerate(row)] for row in values]


def _session_zone(conn: Connection) -> tzinfo:
    dbapi: Any = conn.connection.dbapi_connection
    if conn.dialect.driver == "psycopg":
        return dbapi.info.timezone  # type: ignore[no-any-return]
    name = dbapi.get_parameter_status("TimeZone") or "UTC"
    return ZoneInfo(name)


def _naive_in(zone: tzinfo, value: Any) -> Any:
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(zone).replace(tzinfo=None)
    return value


def _json_text(serialize: Callable[[Any], str], none_as_null: bool, value: Any) -> str | None:
    return None if value is None and none_as_null else serialize(value)
