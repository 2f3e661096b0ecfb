"""kstore's development broker: a real Apache Kafka broker from the official jars, and throwaway
certificates for testing clients' security settings. For tests, the demo and local use; not for
production, and not part of the ``kstore`` distribution.

- :mod:`~kstore_devbroker.broker`: :class:`~kstore_devbroker.broker.Cluster`,
  :class:`~kstore_devbroker.broker.Broker`, :class:`~kstore_devbroker.broker.SecuredBroker`, and
  ``python -m kstore_devbroker fetch|start|stop|run``.
- :mod:`~kstore_devbroker.certs`: certificate authorities and certificates made with the ``openssl`` CLI.

Imports confluent-kafka and its own modules, never kstore (kstore never imports it either:
kstore's import contracts hold that side). A JVM started by a
:class:`~kstore_devbroker.broker.Cluster` (not detached) never outlives the Python process.
"""

#: The distribution's version (its pyproject.toml reads it).
__version__ = "0.1.0"
