"""kstore.kafka without a broker: each client's settings, queues and workarounds."""
