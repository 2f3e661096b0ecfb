"""The outbox and its relay: records produced in a transaction (a batch's, or an application's
through :mod:`kstore.outbox`) are written to the database in that transaction, and published to
Kafka once it committed, exactly once for a ``read_committed`` reader, each key's in commit order.

- the application's API: :mod:`~kstore.relay.application` (``Outbox``, ``Record``; users import
  them from :mod:`kstore.outbox`);
- the database side: :mod:`~kstore.relay.tables` (the tables and the rows read from them),
  :mod:`~kstore.relay.lanes` (a record's shard, a shard's lane, each relay's share),
  :mod:`~kstore.relay.store` (``Outbox``: every statement, made of :mod:`~kstore.relay.shards`,
  :mod:`~kstore.relay.writing`, :mod:`~kstore.relay.leases` and :mod:`~kstore.relay.backlog`),
  :mod:`~kstore.relay.listener` (the relay's LISTEN);
- the Kafka side: :mod:`~kstore.relay.progress` (the progress record's topic, format and reading
  back), :mod:`~kstore.relay.publisher` (the transport's protocol, and a lane's publisher with its
  progress);
- the relay: :mod:`~kstore.relay.loop` (``Relay``: the leases' loop), :mod:`~kstore.relay.publishing`
  (one lane, on its own thread), :mod:`~kstore.relay.departures` (relays whose worker left the
  group), :mod:`~kstore.relay.lane` and :mod:`~kstore.relay.base` (what a relay holds);
  :mod:`~kstore.relay.member` (the name a worker and its relay go by);
- the WAL transport being built beside the tables (:mod:`~kstore.relay.wal`: records carried in
  PostgreSQL's write-ahead log and read from a logical replication slot), not yet used by the relay.

May import the database side (:mod:`kstore.db`), the Kafka side through its seam only
(:mod:`kstore.kafka.seam`, :mod:`kstore.kafka.clients`: never a client's subpackage or library),
what a worker reports (:mod:`kstore.telemetry`), how a processor's records are made and checked
(:mod:`kstore.running`, :mod:`kstore.schemas`) and the shared vocabulary (settings, errors, types).
The engine, the operator's tools, the console and the CLI import it; the database and Kafka sides
never do: the Kafka clients' publishers are transports that carry bytes (pyproject.toml's import
contracts hold it).

Invariants:

- **Commit order, no gap.** Records are spread over a fixed number of shards by key (a key's
  records always in one shard). A transaction that writes records moves on the ``next_seq`` of
  each shard it writes (``UPDATE ... SET next_seq = next_seq + k ... RETURNING``, a shard at a time
  in shard order, so two writers never deadlock), which takes the shard's row lock until COMMIT:
  within a shard ``seq`` follows commit order with no gap. A relay that has published up to ``seq``
  N and reads ``seq > N`` can never skip a row that commits later. (Ids from a sequence would:
  they are taken in statement order, and transactions commit in another.)
- **Published exactly once, in order.** A lane's rows are published after their progress, each
  shard's ``seq`` ascending, a Kafka transaction at a time; each transaction carries the lane's
  progress record (the last ``seq`` of each of its shards), so what Kafka says was published is
  never ahead of or behind what it holds. A new owner reads that record back (after its
  ``init_transactions`` settled the last owner's transaction) and takes the further of it and the
  database's mark, which is only clean-up and the backlog's count. Nothing skips a row: a refused
  row stops its shard until Kafka takes it.
- **Leases and lanes fence.** Shards are published in lanes (:data:`~kstore.relay.lanes.MAX_LANES`
  at most; lane ``n`` publishes shards ``n``, ``n + MAX_LANES``, ...). One relay at a time holds a
  lane, by lease: taking it bumps its epoch, and every later write of the relay's matches that epoch,
  so a paused relay's late writes land nowhere; its producer's transactional id is the lane's, so
  the next owner's producer fences it in Kafka too. Leases run on the database's clock; relays of
  one group share the lanes evenly.
- **Incarnations.** Shards are made with a random incarnation, carried by every progress mark and
  checked by every write and every read of rows to publish: marks left by shards made before (another
  database, or before ``kstore outbox reshard`` made them anew, numbering on) count for nothing, and
  a writer or relay that read the old shards fails rather than number or publish by the old count.
- **Waking.** An idle relay asks the next writer of each shard to NOTIFY (``wake_seq``); only that
  writer does. A NOTIFY missed costs a poll interval (``outbox_poll_interval_s``), never a record.
"""
