"""The exactly-once engine: a running worker, the partitions it holds, and its batches.

- :mod:`~kstore.engine.worker`: :class:`~kstore.engine.worker.Worker`, a plain object (``run()``,
  ``request_stop()``, ``close()``) with a fetch thread and a main loop; it installs no signal handlers.
- :mod:`~kstore.engine.claims`: between batches, the group's side: rebalance events, claims, epoch
  checks; :mod:`~kstore.engine.health`: what a worker says of itself (probes, gauges, outbox backlog).
- :mod:`~kstore.engine.ownership`: the ledger of which partitions this worker holds, at which
  epoch, and where each one reads from (claims, operator resets, ``reset_offsets``).
- :mod:`~kstore.engine.partitions`: one state per partition (pending, owned, held or fenced, with
  its queue of fetched records), moved only by checked transitions.
- :mod:`~kstore.engine.batches`: one batch at a time, in one transaction with its offsets; an outage
  is waited out (:mod:`~kstore.engine.waits`), a processor's failure goes to the failure strategy.
- :mod:`~kstore.engine.commit`: the commit unit: the batch's transaction, the offsets' compare-and-set
  (epoch and start), the revoke check before it, the read back of a lost COMMIT answer.
- :mod:`~kstore.engine.strategies`: what a processor's failure does (isolate, retry in place,
  dead-letter, stop), one file each; :mod:`~kstore.engine.decoding`: a batch as the processor sees it.
- :mod:`~kstore.engine.positions`: where the consumer's position moved, or could not go, by itself.
- :mod:`~kstore.engine.failures`: the retry bookkeeping (attempts, the isolation window, backoff)
  and the dead-letter breaker's count.
- :mod:`~kstore.engine.backoff`: the delay between the worker's database retries.
- :mod:`~kstore.engine.onedatabase`: one pipeline, one database: the group's live members compared
  with the database's registry of its workers before any claim.
(``kstore worker``, :mod:`kstore.cli.worker`, wires SIGTERM/SIGINT to ``request_stop``.)

A worker runs its group's outbox relay (:class:`kstore.relay.loop.Relay`) on a thread of its own, and
goes by the relay's name for it (:func:`kstore.relay.member.member_name`).

May import the outbox and its relay (:mod:`kstore.relay`), the database side (:mod:`kstore.db`), the
Kafka side through its seam only (:mod:`kstore.kafka.seam`, :mod:`kstore.kafka.clients`,
:mod:`kstore.kafka.probe`: never a client's subpackage or library), what a worker reports
(:mod:`kstore.telemetry`), :mod:`kstore.processor` and how it is run (:mod:`kstore.running`), and the
shared vocabulary (settings, errors, targets, retry, types). Never the operator's tools
(:mod:`kstore.ops`), the CLI, :mod:`kstore.testing` or the stub cluster (:mod:`kstore.kafka.stub`):
pyproject.toml's import contracts hold it.

Invariants:

- **Who owns a partition**: the worker whose claim bumped its row's epoch last. A claim is one
  ``UPDATE ... SET epoch = epoch + 1 ... RETURNING next_offset, epoch`` per batch of partitions;
  a commit writes the offsets ``WHERE epoch = <claimed> AND next_offset = <batch start>`` as the
  last statement before COMMIT, so a zombie's late commit matches nothing and rolls back. Each
  partition has one status (pending, owned, held or fenced), changed only by the transitions of
  :class:`~kstore.engine.partitions.Partitions`, which refuse any other move; it is delivered (has
  a queue) exactly while owned; ``owned[tp].committed`` is the offset stored under
  ``owned[tp].epoch``, moved only by a commit this worker saw land.
- **Claim before resume**: no record of a partition reaches the processor before its stored
  offset is applied; nothing is sought or resumed before the claim's transaction answered. A
  failed claim leaves the partition paused (fail closed): Kafka's committed offsets are never read.
- **Rewind**: a batch that did not commit goes back in front of its queues, for each partition
  still owned under the generation it was taken in (see :mod:`~kstore.engine.partitions`), before
  the next fetch.
- **Threads**: the main thread (:meth:`Worker.step`) makes every claim, epoch check, reset and
  batch, every database statement and every processor hook. The fetch thread
  (:meth:`Worker.fetch_once`) fetches through the client (:class:`~kstore.kafka.seam.ConsumerSource`)
  and applies rebalance events; it never touches the database. A client's rebalance callbacks (on
  librdkafka's side inside the fetch, on kafka-python's IO thread) only post events. The database
  deadline's watchdog only cuts sockets.
- **Locks**: :attr:`Partitions.lock <kstore.engine.partitions.Partitions.lock>` guards every
  partition's state and queue. It is held across
  local consumer calls (seek, pause, resume) and, in ``reset_offsets``, across the store write of
  the new position; never across ``poll()``, a batch's transaction, a claim or a read of the log
  bounds: those read under the lock, do their I/O without it, and re-check under it before acting.
"""
