"""The operator's tools: see where a pipeline stands and steer it, with or without a worker running.

- :mod:`~kstore.ops.offsets`: ``kstore offsets show|set|history`` from Python.
- :mod:`~kstore.ops.replay`: dead letters replayed through a processor (``kstore dead-letters replay``).
- :mod:`~kstore.ops.outbox`: a group's outbox shards, what waits to be published (``kstore outbox show``).
- :mod:`~kstore.ops.lag`: a group's lag in messages and seconds, from the database and the brokers;
  :mod:`~kstore.ops.exporter` serves it as Prometheus metrics, :mod:`~kstore.ops.top` in the terminal.
- :mod:`~kstore.ops.topics`: a processor's topics, looked up or created (``kstore topics``).
- :mod:`~kstore.ops.masking`: credentials kept out of what a driver or a client says, wherever kstore
  prints, logs or shows it (the command line, the web console).

Their commands are :mod:`kstore.cli.ops` and :mod:`kstore.cli.letters`.

May import the outbox's statements (:mod:`kstore.relay`), the database side, the Kafka side through
its seam only (:mod:`kstore.kafka.seam` and :mod:`kstore.kafka.clients`: the tools run on whichever
client is installed), :mod:`kstore.telemetry` (the lag metric families), :mod:`kstore.running` (a
replay runs a processor) and the shared vocabulary; never the engine: no worker is needed, and none
is driven from here. A running worker notices what these write (an epoch bumped by a reset) by
itself, within ``epoch_check_interval_s``.

Invariants: a move is one transaction that reads each row under its lock, decides from what is
stored then, bumps the epoch and records the move with a request id (looked up if its COMMIT's
answer is lost); towards the brokers everything here is read-only, but for one copy: after a move,
a group that mirrors its offsets to Kafka (``mirror_offsets``) and has no live member gets them
there too (only lag tools read them). A
:class:`~kstore.ops.lag.LagReader` is not thread-safe: its callers take a lock.
"""
