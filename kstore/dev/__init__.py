"""Development tools that ship in the wheel: a real Apache Kafka broker from the official jars, and
throwaway certificates for testing clients' security settings. Not for production.

- :mod:`~kstore.dev.broker`: :class:`~kstore.dev.broker.Cluster`, :class:`~kstore.dev.broker.Broker`,
  :class:`~kstore.dev.broker.SecuredBroker`, and ``python -m kstore.dev.broker fetch|start|stop|run``
  (``python -m kstore.devbroker``, its old name, still works).
- :mod:`~kstore.dev.certs`: certificate authorities and certificates made with the ``openssl`` CLI.

Nothing in kstore imports this package (only the ``kstore.devbroker`` shim); the tests, the
examples, the demo, the scripts and the benchmarks do. It imports confluent-kafka and its own
modules, nothing else of kstore. A JVM started by a :class:`~kstore.dev.broker.Cluster` (not
detached) never outlives the Python process.
"""
