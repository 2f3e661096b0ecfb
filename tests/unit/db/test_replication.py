"""pgoutput's messages as the WAL reader parses them, built byte by byte with ``struct`` as
PostgreSQL sends them (protocol version 1), and the server checks' decisions on facts rows."""

from __future__ import annotations

import struct

import pytest

from kstore.db.replication import (
    SLOT_PREFIX,
    Begin,
    BrokenPgoutput,
    Commit,
    Message,
    ServerFacts,
    Transaction,
    TransactionAssembler,
    lsn_int,
    parse,
    server_problem,
    slot_name,
)

PREFIX = "kstore.outbox:group:orders"


def begin(final_lsn: int = 0x100, xid: int = 7) -> bytes:
    return b"B" + struct.pack("!qqi", final_lsn, 123456, xid)


def message(content: bytes, prefix: str = PREFIX, lsn: int = 0x90, transactional: bool = True) -> bytes:
    return (b"M" + struct.pack("!bq", 1 if transactional else 0, lsn) + prefix.encode() + b"\0"
            + struct.pack("!i", len(content)) + content)


def commit(commit_lsn: int = 0x100, end_lsn: int = 0x130) -> bytes:
    return b"C" + struct.pack("!bqqq", 0, commit_lsn, end_lsn, 123456)


def test_parse_reads_begin_message_and_commit_fields() -> None:
    assert parse(begin(0x1_0000_0010, xid=-1)) == Begin(0x1_0000_0010, 123456, 0xFFFFFFFF)
    assert parse(message(b"\0payload\0", lsn=0x42)) == Message(True, 0x42, PREFIX, b"\0payload\0")
    assert parse(message(b"x", transactional=False)) == Message(False, 0x90, PREFIX, b"x")
    assert parse(commit(0x200, 0x230)) == Commit(0x200, 0x230, 123456)


def test_parse_skips_kinds_the_reader_does_not_use() -> None:
    for kind in (b"R", b"I", b"U", b"D", b"T", b"Y", b"O", b"S"):
        assert parse(kind + b"\x00\x01anything") is None


@pytest.mark.parametrize("payload", [
    b"",
    begin()[:-1],
    commit()[:-3],
    message(b"content")[:-1],
    message(b"content") + b"extra",
    b"M" + struct.pack("!bq", 1, 0) + b"no terminator",
    b"M" + struct.pack("!bq", 1, 0) + b"p\0" + struct.pack("!i", -1),
    b"M" + struct.pack("!bq", 1, 0) + b"\xff\xfe\0" + struct.pack("!i", 0),
])
def test_parse_refuses_a_message_cut_short_or_malformed(payload: bytes) -> None:
    with pytest.raises(BrokenPgoutput):
        parse(payload)


def feed_all(assembler: TransactionAssembler, *payloads: bytes) -> list[Transaction]:
    return [t for t in (assembler.feed(p) for p in payloads) if t is not None]


def test_assembler_yields_a_transactions_messages_under_the_prefix_in_order() -> None:
    assembler = TransactionAssembler(PREFIX)
    got = feed_all(assembler, begin(), message(b"one"), message(b"other", prefix=PREFIX + "x"),
                   message(b"two"), commit(0x100, 0x130),
                   begin(), message(b"three"), commit(0x200, 0x230))
    assert got == [Transaction(0x100, 0x130, [b"one", b"two"]), Transaction(0x200, 0x230, [b"three"])]


def test_assembler_skips_transactions_without_a_message_under_the_prefix() -> None:
    assembler = TransactionAssembler(PREFIX)
    got = feed_all(assembler, begin(), commit(),
                   begin(), message(b"x", prefix="kstore.outbox:app:orders"), commit(),
                   message(b"nontransactional", transactional=False),
                   begin(), message(b"kept"), commit(0x300, 0x330))
    assert got == [Transaction(0x300, 0x330, [b"kept"])]


@pytest.mark.parametrize("payloads", [
    [begin(), begin()],
    [commit()],
    [message(b"x")],
])
def test_assembler_refuses_messages_out_of_place(payloads: list[bytes]) -> None:
    assembler = TransactionAssembler(PREFIX)
    with pytest.raises(BrokenPgoutput):
        feed_all(assembler, *payloads)


def test_slot_name_fits_postgresqls_rule_and_differs_per_outbox() -> None:
    names = {slot_name(f"kstore.outbox:{kind}:{name}") for kind in ("group", "app") for name in ("a", "b" * 300)}
    assert len(names) == 4
    for name in names:
        assert name.startswith(SLOT_PREFIX) and len(name) <= 63
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789_")


def test_lsn_int_reads_postgresqls_notation() -> None:
    assert lsn_int("0/0") == 0
    assert lsn_int("16/B374D848") == (0x16 << 32) | 0xB374D848


GOOD = ServerFacts(version_num=150004, wal_level="logical", free_slots=3, can_replicate=True, slot_exists=False)


def test_server_problem_passes_a_server_that_can_decode() -> None:
    assert server_problem(GOOD) is None
    # Its own slot already made, a full server still serves the outbox.
    assert server_problem(ServerFacts(150004, "logical", 0, True, True)) is None


@pytest.mark.parametrize(("facts", "fix"), [
    (ServerFacts(130010, "logical", 3, True, False), "PostgreSQL 14 or later"),
    (ServerFacts(150004, "replica", 3, True, False), "wal_level = logical"),
    (ServerFacts(150004, "replica", 3, True, False), "rds.logical_replication = 1"),
    (ServerFacts(150004, "logical", 3, False, False), "REPLICATION"),
    (ServerFacts(150004, "logical", 0, True, False), "max_replication_slots"),
])
def test_server_problem_names_the_fix_in_one_line(facts: ServerFacts, fix: str) -> None:
    problem = server_problem(facts)
    assert problem is not None and fix in problem and "\n" not in problem
