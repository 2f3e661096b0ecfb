"""kstore's Kafka side on confluent-kafka, librdkafka's client (``pip install 'kstore[confluent]'``): the
worker's consumer (:mod:`.consumer`), the relay's shard publisher (:mod:`.producer`), the operator's
questions to the brokers (:mod:`.admin`), and how each client is made from the settings (:mod:`.connect`).

Imported only through :mod:`kstore.kafka.clients`, when the settings choose confluent-kafka.
"""
