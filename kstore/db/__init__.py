"""The database side: kstore's tables and every statement on them, and the batch's session.

- :mod:`~kstore.db.store`: the offsets and reset-history tables, claims, the compare-and-set
  offset commit (in one round trip with its COMMIT on psycopg2), and ``make_engine``.
- :mod:`~kstore.db.resets`: moving stored offsets (with an epoch bump and a history row).
- :mod:`~kstore.db.deadletters`: the dead-letter tables, the write inside a batch, listing and
  status changes (a replay's transaction; the processor is run by :mod:`kstore.ops.replay`);
  :mod:`~kstore.db.letterquery`: which letters (a filter), their counts, keyset pages, and walks
  that discard or resolve every letter a filter matches.
- :mod:`~kstore.db.indoubt`: a COMMIT whose answer was lost is read back on a fresh connection.
- :mod:`~kstore.db.members`: the registry of each group's workers that write to this database.
- :mod:`~kstore.db.session`, :mod:`~kstore.db.manyrows`, :mod:`~kstore.db.copy`,
  :mod:`~kstore.db.sqltext`: the processor's session, its deferred INSERTs sent as many rows,
  ``copy_rows``, and SQL text read as PostgreSQL reads it.
- :mod:`~kstore.db.dbapi`, :mod:`~kstore.db.psycopg2conn`, :mod:`~kstore.db.deadline`: kstore's
  DBAPI connection classes (psycopg2's in a module of their own, imported only for a psycopg2 DSN:
  kstore depends on no driver) and the deadline on every round trip.
- :mod:`~kstore.db.migration` (and :mod:`~kstore.cli.migrate`: ``kstore migrate``),
  :mod:`~kstore.db.sqlerrors` (what an error says), :mod:`~kstore.db.writes` (what every write shares).

May import the shared vocabulary (settings, errors, :mod:`kstore.types`, the retry policy's
``Failure``); never the Kafka side, :mod:`kstore.processor`, :mod:`kstore.running`, the engine, the
operator's tools or the CLI. Inside it, imports run from ``sqlerrors``, ``writes`` and ``sqltext`` up to
``store``, ``migration``, ``deadletters`` and ``letterquery``, with no cycle
(tests/integration/packaging_and_docs/test_layout.py).

Invariants:

- Every write uses bound parameters. A claim and an offset commit both take the partition row's
  lock; an offset commit is a compare-and-set on the epoch and the position the worker believes
  is stored, and matching fewer rows than it moves fails the batch (fenced).
- Every write kstore makes (a batch, a claim, a reset, a dead letter's change) whose COMMIT loses
  its answer is read back on a fresh connection, waiting for the lost transaction's row locks:
  landed, not landed, or :class:`~kstore.errors.CommitInDoubtError`. Never assumed either way.
- A fast path (deferred INSERTs sent together, the one-round-trip commit, COPY) is the plain
  path, faster: every rewritten write's row count is checked before the batch commits.
- A batch's transaction is open only while the batch talks to the database: on psycopg2 its
  ``BEGIN`` rides with its first statement; the processor's own commit()/rollback() on the DBAPI
  connection are refused inside a batch.
- Threads: a connection's work runs on the thread that uses it; the deadline's watchdog thread
  only shuts a socket down, under its own lock, for a round trip still armed.
"""
