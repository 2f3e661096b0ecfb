"""The Kafka side: the worker's consumer and its queues, and every Kafka client kstore makes.

- :mod:`~kstore.kafka.consumer`: :class:`~kstore.kafka.consumer.KafkaSource` (the consumer, the
  rebalance listener, per-partition queues of fetched records, the lock that keeps fetching,
  delivering and resetting a partition apart).
- :mod:`~kstore.kafka.inspector`: :class:`~kstore.kafka.inspector.KafkaInspector`, the questions of
  ``kstore offsets`` (partitions, log bounds, a group's live members), asked again while the
  brokers answer "not now".
- :mod:`~kstore.kafka.confluent`: :class:`~kstore.kafka.confluent.ConfluentSource`, the same seam on
  confluent-kafka (librdkafka), with :mod:`~kstore.kafka.rdconnect` (its client from the same Settings);
  :mod:`~kstore.kafka.backends` picks one by ``kafka_client``.
- :mod:`~kstore.kafka.connect`: every client built from one Settings (TLS context, SASL, options).
- :mod:`~kstore.kafka.probe`: a look at the first broker that names a setup mistake at once.
- :mod:`~kstore.kafka.logreader`: partitions, log bounds and one record's timestamp, for the lag.
- :mod:`~kstore.kafka.members`: a group's live members (describe group) in one plain shape, for the
  one-database guard.

The one package that imports kafka-python and confluent-kafka (the worker's second backend sits
beside kafka-python's, behind the same few methods). May import the shared vocabulary (settings,
kafkaoptions, rdkafkaoptions, errors, records); never the database side, the engine, the operator's
tools or the CLI. Named ``kstore.kafka``: inside it, ``from kafka import ...`` is kafka-python
(imports are absolute).

Invariants (the engine relies on them):

- **Owned <=> queued**: a partition has a queue exactly while the ledger delivers it;
  ``own`` creates it, ``disown`` removes it; records of a partition without one are dropped.
- **A generation** is a number from one counter per worker that only grows, given to a queue
  at every flush (own, reset, disown). A batch remembers each partition's generation when taken,
  and goes back (``requeue``) only where it is unchanged: records fetched before a flush never
  reach a queue made after it, even a new queue for the same partition.
- **Threads**: rebalance callbacks run on kafka-python's IO thread (librdkafka's: on the fetch
  thread, inside ``consume()``) and must not block nor take the lock: they pause and record.
  The fetch thread polls and applies their events; the main thread takes, requeues, owns and
  disowns. Both under the lock. (With librdkafka the main thread leaves the consumer's part of
  own and disown to the fetch thread: see :mod:`~kstore.kafka.confluent`.)
- **Locks during I/O**: the lock is held across local consumer calls (seek, pause, resume),
  never across network I/O (``poll()``, log bounds).
"""

import warnings

with warnings.catch_warnings():
    # kafka-python 3.0 reads each of its protocol schemas, when it is imported, with
    # importlib.resources' read_text (which calls open_text): both deprecated in Python 3.11
    # and 3.12 (no longer in 3.13), two warnings a schema, about 220 in every user's test run.
    # No call of kstore's can avoid them: only these two, and only during this import, are
    # silenced. kstore imports kafka-python here first (``import kstore`` imports this package).
    warnings.filterwarnings("ignore", r"(read_text|open_text) is deprecated\. Use files\(\) instead",
                            DeprecationWarning)
    import kafka  # noqa: F401
