"""The outbox's WAL transport, read side: an outbox's logical replication slot and publication, the
server's checks, and a streaming reader of its committed transactions (pgoutput, ``messages 'true'``).

Here rather than under :mod:`kstore.relay.wal` because it speaks the replication protocol through
psycopg2's ``LogicalReplicationConnection`` (psycopg 3 has none) and only the database side imports
the drivers; psycopg2 is imported when a slot is set up or read, so kstore still runs without it.

Invariants:

- **One slot, one publication, one outbox.** Both are named by :func:`slot_name` (a digest of the
  outbox's identity, within PostgreSQL's 63 characters of ``[a-z0-9_]``); the publication is empty,
  because pgoutput requires one and transactional messages need no table. Setting them up is
  idempotent, and refuses with one line naming the fix when the server cannot decode
  (:func:`server_problem`).
- **Commit order, committed only.** :meth:`WalReader.next_transaction` yields whole transactions,
  in commit order, with the content of each message under the reader's prefix in emitted order;
  a rolled-back transaction is never decoded, a transaction with none of the prefix's messages is
  skipped, and so is a non-transactional message.
- **Only what the caller confirms.** The server learns a position as flushed only through
  :meth:`WalReader.confirm` (the relay confirms after Kafka committed): a reader that reconnects
  starts after the last confirmed transaction, and without a confirm gets the same transactions
  again. (psycopg2 answers a keepalive that asks for a reply itself, with the last confirmed
  position; while everything received was confirmed it may move that position to the server's WAL
  end, past only transactions with nothing under any decoded prefix, so nothing is lost.)
- **One reader per slot: a natural lease.** PostgreSQL lets one connection stream a slot; a second
  gets :class:`SlotInUse`. A reader that stops answering (SIGSTOP, a cut network) keeps the slot
  until the server's ``wal_sender_timeout`` (default 60 s) ends its walsender; that setting is
  ``PGC_USERSET`` and may be set per replication connection (``options='-c wal_sender_timeout=5s'``),
  and the holder's own value is the one that ends it.
- **A lost slot stops the relay.** A slot whose WAL the server removed (``wal_status`` ``lost``) can
  no longer give every transaction: :func:`slot_state` raises :class:`SlotLost` with one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import select
import struct
import time
from dataclasses import dataclass
from typing import Any

#: The prefix of every outbox's slot and publication name.
SLOT_PREFIX = "kstore_outbox_"
#: PostgreSQL 14 added logical decoding messages to pgoutput.
MIN_SERVER_VERSION = 140000

# pgoutput's messages, protocol version 1: Begin (final LSN, commit time, xid), Message (flags, LSN,
# prefix, length, content), Commit (flags, commit LSN, end LSN, commit time).
_BEGIN = struct.Struct("!qqI")
_MESSAGE_HEAD = struct.Struct("!bq")
_LENGTH = struct.Struct("!i")
_COMMIT = struct.Struct("!bqqq")
# Message's flags: bit 0 set for a transactional message.
_TRANSACTIONAL = 1


class ReplicationError(Exception):
    """The WAL transport cannot read its slot; the message says why and, where it can, the fix."""


class SlotInUse(ReplicationError):
    """Another connection streams the slot: for a relay, another relay holds the outbox."""


class SlotLost(ReplicationError):
    """The server removed WAL the slot still needed: transactions are gone, the relay must stop."""


class BrokenPgoutput(ReplicationError):
    """A pgoutput message cut short or out of place: nothing after it can be trusted."""


def slot_name(identity: str) -> str:
    """The slot's (and its publication's) name for the outbox named ``identity`` (its prefix)."""
    return SLOT_PREFIX + hashlib.sha256(identity.encode()).hexdigest()[:40]


# -- pgoutput ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_time: int  # microseconds since 2000-01-01, as PostgreSQL counts
    xid: int


@dataclass(frozen=True)
class Message:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_time: int


def parse(payload: bytes) -> Begin | Message | Commit | None:
    """One pgoutput message; ``None`` for a kind the reader does not use (relation, insert, ...)."""
    if not payload:
        raise BrokenPgoutput("an empty pgoutput message")
    kind, body = payload[:1], memoryview(payload)[1:]
    try:
        if kind == b"B":
            final_lsn, commit_time, xid = _BEGIN.unpack_from(body)
            return Begin(final_lsn, commit_time, xid)
        if kind == b"M":
            flags, lsn = _MESSAGE_HEAD.unpack_from(body)
            end = bytes(body[_MESSAGE_HEAD.size:]).index(b"\0") + _MESSAGE_HEAD.size
            prefix = bytes(body[_MESSAGE_HEAD.size:end]).decode()
            (length,) = _LENGTH.unpack_from(body, end + 1)
            start = end + 1 + _LENGTH.size
            if length < 0 or start + length != len(body):
                raise BrokenPgoutput(f"a pgoutput message of {len(body)} bytes says its content has {length}")
            return Message(bool(flags & _TRANSACTIONAL), lsn, prefix, bytes(body[start:]))
        if kind == b"C":
            _flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(body)
            return Commit(commit_lsn, end_lsn, commit_time)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise BrokenPgoutput(f"a pgoutput {kind!r} message cut short or malformed: {exc}") from exc
    return None


@dataclass(frozen=True)
class Transaction:
    """A committed transaction's messages under the reader's prefix, in the order they were emitted."""

    commit_lsn: int
    end_lsn: int
    messages: list[bytes]


class TransactionAssembler:
    """pgoutput messages in, committed transactions with a message under ``prefix`` out."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._open: list[bytes] | None = None

    def feed(self, payload: bytes) -> Transaction | None:
        message = parse(payload)
        if isinstance(message, Begin):
            if self._open is not None:
                raise BrokenPgoutput("a pgoutput Begin inside a transaction")
            self._open = []
        elif isinstance(message, Message):
            # A non-transactional message comes outside any transaction: the outbox never writes one.
            if message.transactional and message.prefix == self.prefix:
                if self._open is None:
                    raise BrokenPgoutput("a transactional pgoutput Message outside a transaction")
                self._open.append(message.content)
        elif isinstance(message, Commit):
            if self._open is None:
                raise BrokenPgoutput("a pgoutput Commit outside a transaction")
            messages, self._open = self._open, None
            if messages:
                return Transaction(message.commit_lsn, message.end_lsn, messages)
        return None


# -- the server's checks, the slot and its publication -------------------------------------------


@dataclass(frozen=True)
class ServerFacts:
    version_num: int
    wal_level: str
    free_slots: int
    can_replicate: bool
    slot_exists: bool


def server_problem(facts: ServerFacts) -> str | None:
    """Why this server cannot give the outbox a slot, in one line naming the fix; ``None`` if it can."""
    if facts.version_num < MIN_SERVER_VERSION:
        return (f"PostgreSQL {facts.version_num // 10000} cannot decode messages with pgoutput: "
                "the WAL outbox needs PostgreSQL 14 or later")
    if facts.wal_level != "logical":
        return (f"wal_level is {facts.wal_level!r}: set wal_level = logical and restart "
                "(RDS/Aurora: rds.logical_replication = 1)")
    if not facts.can_replicate:
        return ("the role lacks REPLICATION: ALTER ROLE ... WITH REPLICATION "
                "(RDS/Aurora: GRANT rds_replication TO ...)")
    if not facts.slot_exists and facts.free_slots <= 0:
        return "no free replication slot: raise max_replication_slots (and restart) or drop an unused slot"
    return None


_FACTS = """
SELECT current_setting('server_version_num')::int,
       current_setting('wal_level'),
       current_setting('max_replication_slots')::int - (SELECT count(*) FROM pg_replication_slots),
       EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolreplication OR rolsuper))
         OR (EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')
             AND pg_has_role(current_user, 'rds_replication', 'MEMBER')),
       EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = %s)
"""


def _connect(dsn: str, **kwargs: Any) -> Any:
    import psycopg2

    conn = psycopg2.connect(dsn, **kwargs)
    conn.autocommit = True
    return conn


def check_server(dsn: str, identity: str) -> None:
    """Raise :class:`ReplicationError` with one line if the server cannot give ``identity`` a slot."""
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(_FACTS, (slot_name(identity),))
            row = cur.fetchone()
    finally:
        conn.close()
    problem = server_problem(ServerFacts(*row))
    if problem is not None:
        raise ReplicationError(problem)


def setup_slot(dsn: str, identity: str) -> str:
    """Check the server, then create the outbox's publication and slot if missing; the slot's name."""
    import psycopg2.errors

    check_server(dsn, identity)
    name = slot_name(identity)
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            # Two relays setting up at once: the loser of either race finds the object made.
            cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
            if cur.fetchone() is None:
                with contextlib.suppress(psycopg2.errors.DuplicateObject):
                    cur.execute(f'CREATE PUBLICATION "{name}"')
            cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (name,))
            if cur.fetchone() is None:
                with contextlib.suppress(psycopg2.errors.DuplicateObject):
                    cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    finally:
        conn.close()
    return name


def drop_slot(dsn: str, identity: str) -> None:
    """Drop the outbox's slot and publication if present (the slot must not be streamed)."""
    import psycopg2.errors

    name = slot_name(identity)
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            try:
                cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                            "WHERE slot_name = %s", (name,))
            except psycopg2.errors.ObjectInUse as exc:
                raise SlotInUse(f"replication slot {name} is streamed by another connection: "
                                f"{str(exc).strip()}") from exc
            cur.execute(f'DROP PUBLICATION IF EXISTS "{name}"')
    finally:
        conn.close()


@dataclass(frozen=True)
class SlotState:
    confirmed_flush_lsn: int
    retained_bytes: int
    wal_status: str
    active_pid: int | None


def lsn_int(text: str) -> int:
    """An LSN as PostgreSQL writes it (``16/B374D848``) as an integer."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def slot_state(dsn: str, identity: str) -> SlotState:
    """The slot's confirmed position, the WAL it retains, its status and streaming pid.

    Raises :class:`SlotLost` for a slot whose WAL is gone, :class:`ReplicationError` for none."""
    name = slot_name(identity)
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT confirmed_flush_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), "
                        "wal_status, active_pid FROM pg_replication_slots WHERE slot_name = %s", (name,))
            row = cur.fetchone()
    finally:
        conn.close()
    if row is None:
        raise ReplicationError(f"replication slot {name} for {identity} does not exist: set the outbox up first")
    confirmed, retained, status, pid = row
    if status == "lost":
        raise SlotLost(f"replication slot {name} for {identity} is lost: the server removed WAL it needed "
                       "(raise max_slot_wal_keep_size); records may be missing, drop and recreate the outbox's slot")
    return SlotState(lsn_int(confirmed) if confirmed else 0, int(retained or 0), status, pid)


# -- the streaming reader ------------------------------------------------------------------------


class WalReader:
    """Streams one outbox's slot: committed transactions with a message under ``prefix``.

    Opened with :meth:`open`; raises :class:`SlotInUse` when another connection streams the slot.
    A cut connection raises :class:`ReplicationError` from :meth:`next_transaction`: open a new
    reader, which starts after the last confirmed transaction."""

    def __init__(self, conn: Any, cursor: Any, slot: str, prefix: str) -> None:
        self._conn = conn
        self._cursor = cursor
        self.slot = slot
        self._assembler = TransactionAssembler(prefix)

    @classmethod
    def open(cls, dsn: str, identity: str, prefix: str, start_lsn: int = 0, **connect_kwargs: Any) -> WalReader:
        import psycopg2
        import psycopg2.errors
        import psycopg2.extras

        name = slot_name(identity)
        conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection,
                                **connect_kwargs)
        cursor = conn.cursor()
        try:
            cursor.start_replication(slot_name=name, decode=False, start_lsn=start_lsn, options={
                "proto_version": "1", "publication_names": name, "messages": "true"})
        except psycopg2.errors.ObjectInUse as exc:
            conn.close()
            raise SlotInUse(f"replication slot {name} for {identity} is streamed by another reader: "
                            f"{str(exc).strip()}") from exc
        except psycopg2.Error as exc:
            conn.close()
            raise ReplicationError(f"cannot stream replication slot {name} for {identity}: "
                                   f"{str(exc).strip()}") from exc
        return cls(conn, cursor, name, prefix)

    def next_transaction(self, timeout: float) -> Transaction | None:
        """The next committed transaction with a message under the prefix, or ``None`` after
        ``timeout`` seconds without one (so the caller can check whether to stop)."""
        import psycopg2

        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._cursor.read_message()
                if message is None:
                    # Status updates at the interval keep the server from ending an idle reader.
                    self._cursor.send_feedback()
            except psycopg2.Error as exc:
                raise ReplicationError(f"replication slot {self.slot}: the connection broke: "
                                       f"{str(exc).strip()}") from exc
            if message is not None:
                transaction = self._assembler.feed(bytes(message.payload))
                if transaction is not None:
                    return transaction
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self._conn], [], [], min(left, 1.0))

    def confirm(self, lsn: int) -> None:
        """Tell the server every transaction up to ``lsn`` (a transaction's ``end_lsn``) is done."""
        import psycopg2

        try:
            self._cursor.send_feedback(flush_lsn=lsn, force=True)
        except psycopg2.Error as exc:
            raise ReplicationError(f"replication slot {self.slot}: the connection broke: "
                                   f"{str(exc).strip()}") from exc

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> WalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
