"""The exactly-once engine: a running worker, the partitions it holds, and its batches.

- :mod:`~kstore.engine.worker`: :class:`~kstore.engine.worker.Worker`, a plain object (``run()``,
  ``request_stop()``, ``close()``) with a fetch thread and a main loop; it installs no signal handlers.
- :mod:`~kstore.engine.ownership`: the ledger of which partitions this worker holds, at which
  epoch, and where each one reads from (claims, operator resets, ``reset_offsets``).
- :mod:`~kstore.engine.batches`: one batch at a time, in one transaction with its offsets, and
  what goes wrong (fencing, retries in smaller batches, dead letters, the database going away).
- :mod:`~kstore.engine.positions`: where the consumer's position moved, or could not go, by itself.
- :mod:`~kstore.engine.failures`: the retry bookkeeping (attempts, the isolation window, backoff).
- :mod:`~kstore.engine.backoff`: the delay between the worker's database retries.
- :mod:`~kstore.engine.relay`: publishes a group's outbox; :mod:`~kstore.engine.member`: the name a
  worker and its relay go by.
- :mod:`~kstore.engine.onedatabase`: one pipeline, one database: the group's live members compared
  with the database's registry of its workers before any claim.
(``kstore worker``, :mod:`kstore.cli.worker`, wires SIGTERM/SIGINT to ``request_stop``.)

May import the database side (:mod:`kstore.db`), the Kafka side through its seam only
(:mod:`kstore.kafka.seam`, :mod:`kstore.kafka.clients`, :mod:`kstore.kafka.probe`: never a client's
subpackage or library), what a worker reports (:mod:`kstore.telemetry`), :mod:`kstore.processor`
and how it is run (:mod:`kstore.running`), and the shared vocabulary (settings, errors, targets,
retry, types). Never the operator's tools (:mod:`kstore.ops`),
the CLI or :mod:`kstore.testing` (pyproject.toml's import contracts hold it).

Invariants:

- **Who owns a partition**: the worker whose claim bumped its row's epoch last. A claim is one
  ``UPDATE ... SET epoch = epoch + 1 ... RETURNING next_offset, epoch`` per batch of partitions;
  a commit writes the offsets ``WHERE epoch = <claimed> AND next_offset = <batch start>`` as the
  last statement before COMMIT, so a zombie's late commit matches nothing and rolls back. A
  partition is delivered (has a queue in the source) exactly while it is in ``Ledger.owned``;
  ``owned``, ``held`` and ``pending`` are disjoint; ``owned[tp].committed`` is the offset stored
  under ``owned[tp].epoch``, moved only by a commit this worker saw land.
- **Claim before resume**: no record of a partition reaches the processor before its stored
  offset is applied; nothing is sought or resumed before the claim's transaction answered. A
  failed claim leaves the partition paused (fail closed): Kafka's committed offsets are never read.
- **Rewind**: a batch that did not commit goes back in front of its queues, for each partition
  still owned under the generation it was taken in (see :mod:`kstore.kafka`), before the next poll.
- **Threads**: the main thread (:meth:`Worker.step`) makes every claim, epoch check, reset and
  batch, every database statement and every processor hook. The fetch thread
  (:meth:`Worker.fetch_once`) polls and applies rebalance events; it never touches the database.
  kafka-python's IO thread runs the rebalance listener, which only pauses and records. The
  database deadline's watchdog only cuts sockets.
- **Locks**: :attr:`KafkaSource.lock` guards the queues and the ledger's maps. It is held across
  local consumer calls (seek, pause, resume) and, in ``reset_offsets``, across the store write of
  the new position; never across ``poll()``, a batch's transaction, a claim or a read of the log
  bounds: those read under the lock, do their I/O without it, and re-check under it before acting.
"""
