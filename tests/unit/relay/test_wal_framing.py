"""The WAL transport's framing: records come back from their messages exactly as encoded (none apart
from empty, any unicode), split over messages at the bound in order, and a message this kstore
cannot read is refused, never read as records."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kstore.relay.wal.framing import MAGIC, MAX_MESSAGE_BYTES, VERSION, FramingError, decode, encode
from kstore.types import Produced

_records = st.builds(
    Produced,
    topic=st.text(max_size=40),
    value=st.none() | st.binary(max_size=200),
    key=st.none() | st.binary(max_size=60),
    headers=st.lists(st.tuples(st.text(max_size=20), st.none() | st.binary(max_size=30)), max_size=5)
    .map(tuple),
    partition=st.none() | st.integers(min_value=0, max_value=2**31 - 1),
)


def _decode_all(messages: list[bytes]) -> list[Produced]:
    return [r for m in messages for r in decode(m)]


@settings(max_examples=300, deadline=None)
@given(st.lists(_records, max_size=30), st.integers(min_value=1, max_value=2000))
def test_any_records_come_back_identically_and_in_order_whatever_the_bound(
        records: list[Produced], bound: int) -> None:
    messages = encode(records, bound)
    assert _decode_all(messages) == records
    for message in messages:
        assert len(message) <= bound or len(decode(message)) == 1, "only a lone record exceeds the bound"


def test_none_and_empty_stay_apart() -> None:
    records = [
        Produced("t", None, None, (("h", None),), None),
        Produced("t", b"", b"", (("h", b""),), 0),
    ]
    back = decode(encode(records)[0])
    assert back == records
    assert back[0].value is None and back[0].key is None and back[0].headers[0][1] is None
    assert back[1].value == b"" and back[1].key == b"" and back[1].headers[0][1] == b""
    assert back[0].partition is None and back[1].partition == 0


def test_unicode_topics_and_header_names_come_back() -> None:
    record = Produced("commandes-été.注文", b"v", b"k", (("trace-ид", b"1"), ("🙂", None)), 7)
    assert decode(encode([record])[0]) == [record]


def test_no_records_no_message() -> None:
    assert encode([]) == []


def test_records_are_split_at_the_bound_and_a_larger_one_goes_alone() -> None:
    small = [Produced("t", b"x" * 1000, str(i).encode()) for i in range(10)]
    one = len(encode(small[:1])[0])
    messages = encode(small, one * 3)
    assert [len(decode(m)) for m in messages] == [3, 3, 3, 1]
    big = Produced("t", b"y" * (one * 5))
    messages = encode([small[0], big, small[1]], one * 3)
    assert [decode(m) for m in messages] == [[small[0]], [big], [small[1]]]
    assert len(messages[1]) > one * 3


def test_the_default_bound_splits_a_large_batch() -> None:
    records = [Produced("t", bytes(1024 * 1024), str(i).encode()) for i in range(20)]
    messages = encode(records)
    assert len(messages) == 3
    assert all(len(m) <= MAX_MESSAGE_BYTES for m in messages)
    assert _decode_all(messages) == records


def test_an_unknown_version_or_magic_is_refused() -> None:
    message = encode([Produced("t", b"v")])[0]
    assert message[:3] == MAGIC + bytes([VERSION])
    with pytest.raises(FramingError, match="version 2"):
        decode(MAGIC + bytes([2]) + message[3:])
    with pytest.raises(FramingError, match="not a kstore WAL message"):
        decode(b"XX" + message[2:])


def test_a_truncated_message_or_one_with_bytes_left_over_is_refused() -> None:
    message = encode([Produced("topic", b"value", b"key", (("h", b"hv"),), 3)] * 2)[0]
    for cut in range(len(message)):
        with pytest.raises(FramingError):
            decode(message[:cut])
    with pytest.raises(FramingError, match="after its 2 records"):
        decode(message + b"\0")


def test_a_negative_length_other_than_none_is_refused() -> None:
    message = bytearray(encode([Produced("t", b"v")])[0])
    # The value's length follows the header, the topic's length and name, the partition and the key's length.
    at = 7 + 2 + 1 + 4 + 4
    assert struct.unpack_from(">i", message, at) == (1,)
    struct.pack_into(">i", message, at, -2)
    with pytest.raises(FramingError):
        decode(bytes(message))


def test_records_that_cannot_be_framed_are_refused() -> None:
    with pytest.raises(FramingError, match="partition"):
        encode([Produced("t", b"v", partition=-1)])
    with pytest.raises(FramingError, match="topic"):
        encode([Produced("t" * 70000, b"v")])
