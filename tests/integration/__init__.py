"""Against the real Kafka broker and PostgreSQL started by the fixtures, by feature."""
