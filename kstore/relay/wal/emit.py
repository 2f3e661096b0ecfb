"""The WAL transport's write: a transaction's records emitted as transactional logical decoding
messages, through the caller's connection, inside the caller's transaction.

Each framed message (:mod:`~kstore.relay.wal.framing`) is one ``pg_logical_emit_message(true,
prefix, content)`` statement, in order: separate statements, because PostgreSQL does not promise the
order it evaluates one SELECT's columns in, and a transaction's messages must be decoded in the
order they were framed. A message emitted as transactional is decoded only when its transaction
commits, and not if it (or the savepoint around the message) rolls back: the records are as durable
as the caller's other writes, and no more.

Each statement also reads the server's ``wal_level``: a server that does not decode its WAL
(``wal_level`` below ``logical``) would take the messages and no relay could ever read them, so the
write fails (:class:`WalUnavailableError`) and the caller's transaction with it, as it does on a
database that is not PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, LargeBinary, Text, bindparam, text

from kstore.errors import ConfigurationError
from kstore.types import Produced

from .framing import MAX_MESSAGE_BYTES, encode

_EMIT = text(
    "SELECT current_setting('wal_level'), pg_logical_emit_message(true, :prefix, :content)"
).bindparams(bindparam("prefix", type_=Text), bindparam("content", type_=LargeBinary))


class WalUnavailableError(ConfigurationError):
    """The database cannot carry the WAL transport: not PostgreSQL, or ``wal_level`` not ``logical``."""


def emit(conn: Connection, prefix: str, records: Iterable[Produced],
         max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Write the records to the WAL under ``prefix`` in ``conn``'s transaction; the messages' count.

    Nothing is written for no records. The caller commits (or rolls back) as with any other write.
    """
    dialect = conn.dialect.name
    if dialect != "postgresql":
        raise WalUnavailableError(f"the WAL outbox needs PostgreSQL with wal_level=logical, not {dialect}")
    messages = encode(records, max_bytes)
    for content in messages:
        level = conn.execute(_EMIT, {"prefix": prefix, "content": content}).scalar_one()
        if level != "logical":
            raise WalUnavailableError(
                f"the WAL outbox needs PostgreSQL's wal_level=logical, the server's is {level}")
    return len(messages)
