"""The WAL transport's framing: a transaction's records as compact, versioned binary messages.

A message is a header (magic ``KW``, a version byte, the record count) then each record: its
topic, partition, key, value and headers (:class:`kstore.types.Produced`, all the relay publishes),
lengths big-endian, ``-1`` for none (so none and empty stay apart). :func:`encode` splits a
transaction's records over as many messages as keep each under :data:`MAX_MESSAGE_BYTES`, in order;
a record larger than that alone gets a message of its own. :func:`decode` gives back exactly the
records encoded, or raises :class:`FramingError`: an unknown magic or version, a message cut short
or with bytes left over is never read as records.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from kstore.errors import KstoreError
from kstore.types import Produced

#: The framing's magic bytes, first in every message.
MAGIC = b"KW"
#: The framing's version: a reader refuses any other.
VERSION = 1
#: A message's bound: records are split over messages that stay under it (a single larger record
#: excepted). The WAL takes far larger, but a reader holds a whole message in memory at once.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# Message header: magic, version, record count.
_HEADER = struct.Struct(">2sBI")
# A length-prefixed string (topic, header name).
_U16 = struct.Struct(">H")
# After the topic: partition, key length, value length, header count (-1: none).
_RECORD = struct.Struct(">iiiH")
# A header's value length (-1: none), after its name.
_I32 = struct.Struct(">i")
_I32_MAX = 2**31 - 1


class FramingError(KstoreError):
    """A WAL message that cannot be read as records, or records that cannot be framed."""


def _bytes_len(data: bytes | None, what: str) -> int:
    if data is None:
        return -1
    if len(data) > _I32_MAX:
        raise FramingError(f"a record's {what} of {len(data)} bytes is too large to frame")
    return len(data)


def _name(text: str, what: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > 0xFFFF:
        raise FramingError(f"a record's {what} of {len(data)} bytes is too large to frame")
    return data


def encode_record(record: Produced) -> bytes:
    """One record's frame (without the message's header)."""
    partition = record.partition
    if partition is not None and not 0 <= partition <= _I32_MAX:
        raise FramingError(f"a record's partition {partition} is out of range")
    if len(record.headers) > 0xFFFF:
        raise FramingError(f"a record's {len(record.headers)} headers are too many to frame")
    topic = _name(record.topic, "topic")
    parts = [
        _U16.pack(len(topic)), topic,
        _RECORD.pack(-1 if partition is None else partition, _bytes_len(record.key, "key"),
                     _bytes_len(record.value, "value"), len(record.headers)),
        record.key or b"", record.value or b"",
    ]
    for name, value in record.headers:
        name_bytes = _name(name, "header name")
        parts += [_U16.pack(len(name_bytes)), name_bytes, _I32.pack(_bytes_len(value, "header value")),
                  value or b""]
    return b"".join(parts)


def _message(frames: list[bytes]) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, len(frames)) + b"".join(frames)


def encode(records: Iterable[Produced], max_bytes: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """The records' messages, in order, each at most ``max_bytes`` unless one record alone is larger.

    No records, no messages.
    """
    messages: list[bytes] = []
    frames: list[bytes] = []
    size = _HEADER.size
    for record in records:
        frame = encode_record(record)
        if frames and size + len(frame) > max_bytes:
            messages.append(_message(frames))
            frames, size = [], _HEADER.size
        frames.append(frame)
        size += len(frame)
    if frames:
        messages.append(_message(frames))
    return messages


def decode(message: bytes) -> list[Produced]:
    """The records of one message, as encoded; :class:`FramingError` if it is not one this reads."""
    view = memoryview(message)
    try:
        magic, version, count = _HEADER.unpack_from(view, 0)
    except struct.error as e:
        raise FramingError(f"a WAL message of {len(message)} bytes is too short for its header") from e
    if magic != MAGIC:
        raise FramingError(f"not a kstore WAL message (magic {magic!r})")
    if version != VERSION:
        raise FramingError(f"a WAL message of framing version {version}, this kstore reads {VERSION} only")
    pos = _HEADER.size
    records: list[Produced] = []
    try:
        for _ in range(count):
            topic, pos = _text(view, pos)
            partition, key_len, value_len, header_count = _RECORD.unpack_from(view, pos)
            pos += _RECORD.size
            key, pos = _take(view, pos, key_len)
            value, pos = _take(view, pos, value_len)
            headers = []
            for _ in range(header_count):
                name, pos = _text(view, pos)
                (value_len,) = _I32.unpack_from(view, pos)
                header_value, pos = _take(view, pos + _I32.size, value_len)
                headers.append((name, header_value))
            records.append(Produced(topic=topic, value=value, key=key, headers=tuple(headers),
                                    partition=None if partition == -1 else partition))
    except struct.error as e:
        raise FramingError(f"a WAL message malformed or cut short ({len(message)} bytes, record {len(records)} "
                           f"of {count})") from e
    except UnicodeDecodeError as e:
        raise FramingError(f"a WAL message with a name that is not UTF-8 (record {len(records)})") from e
    if pos != len(message):
        raise FramingError(f"a WAL message with {len(message) - pos} bytes after its {count} records")
    return records


def _text(view: memoryview, pos: int) -> tuple[str, int]:
    (length,) = _U16.unpack_from(view, pos)
    pos += _U16.size
    if pos + length > len(view):
        raise struct.error("text past the message's end")
    return str(view[pos:pos + length], "utf-8"), pos + length


def _take(view: memoryview, pos: int, length: int) -> tuple[bytes | None, int]:
    if length == -1:
        return None, pos
    if length < 0 or pos + length > len(view):
        raise struct.error("bytes past the message's end")
    return bytes(view[pos:pos + length]), pos + length
