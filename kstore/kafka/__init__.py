"""The Kafka side: every Kafka client kstore makes, behind one narrow seam.

- :mod:`~kstore.kafka.seam`: what the engine, the relay and the operator's tools know of Kafka: the
  plain types and the protocols a client implements.
- :mod:`~kstore.kafka.clients`: the client the settings choose (``kafka_client``, ``relay_client``;
  the operator's tools take the other when that one is not installed), imported only then; a client
  not installed is one line naming its extra.
- :mod:`~kstore.kafka.confluent` and :mod:`~kstore.kafka.kafkapython`: the two clients, peers: neither
  imports the other.
- :mod:`~kstore.kafka.stub`: an in-memory cluster behind the same seam, for tests (kstore's
  simulation, and users' through a worker's ``source_factory``); it imports no client library, and
  nothing kstore runs in production imports it.
- :mod:`~kstore.kafka.probe`: a look at the first broker that names a setup mistake at once.
- :mod:`~kstore.kafka.security` (the TLS context, a token provider) and :mod:`~kstore.kafka.asking`
  (asking the brokers again while they say "not now"): what both clients share, needing neither.

The engine, the relay and the operator's tools import only the seam, the clients module and the
probe (pyproject.toml's import contracts hold it).

- :mod:`~kstore.kafka.options` and :mod:`~kstore.kafka.rdkafkaoptions`: which options each client
  accepts, and which hold a secret; :class:`~kstore.Settings` checks its options with them, so they
  import nothing of kstore but its errors (the one import from below into this package).

May import the shared vocabulary (settings, errors, types); never the
database side, the engine, the operator's tools or the CLI.
"""
