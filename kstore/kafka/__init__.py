"""The Kafka side: every Kafka client kstore makes, behind one narrow seam.

- :mod:`~kstore.kafka.seam`: what the engine, the relay and the operator's tools know of Kafka: the
  plain types and the protocols a client implements.
- :mod:`~kstore.kafka.clients`: the client the settings choose (``kafka_client``), imported only
  then; a client not installed is one line naming its extra.
- :mod:`~kstore.kafka.confluent` and :mod:`~kstore.kafka.kafkapython`: the two clients, peers: neither
  imports the other.
- :mod:`~kstore.kafka.probe`: a look at the first broker that names a setup mistake at once.

May import the shared vocabulary (settings, kafkaoptions, rdkafkaoptions, errors, records); never the
database side, the engine, the operator's tools or the CLI.
"""
