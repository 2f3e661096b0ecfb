"""The outbox's WAL transport: a transaction's records written to PostgreSQL's write-ahead log as
transactional logical decoding messages, and read back, in commit order, from a logical replication
slot (pgoutput, ``messages 'true'``, PostgreSQL 14+), instead of as rows of the outbox's tables.

- :mod:`~kstore.relay.wal.framing`: the records' binary framing, one or more messages per
  transaction;
- :mod:`~kstore.relay.wal.emit`: writing them, in the caller's transaction;
- :mod:`kstore.db.replication` (under the database side, which alone imports the drivers): the
  outbox's slot and publication, the server's checks, and the streaming reader of committed
  transactions.

Invariants so far:

- **Transactional.** Records are emitted with ``pg_logical_emit_message(true, ...)`` in the
  writer's own transaction: decoded only if, and when, that transaction commits, in commit order;
  a rollback (or a rolled-back savepoint) leaves nothing to decode.
- **One outbox, one prefix.** Each message's prefix names the outbox it belongs to
  (``kstore.outbox:<kind>:<name>``); a transaction's messages keep the order they were emitted in.
- **Versioned framing.** A reader refuses a message whose version it does not know, or one cut
  short, rather than publish a guess.
"""
