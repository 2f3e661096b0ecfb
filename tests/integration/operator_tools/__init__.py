"""The operator's commands: offsets, top, the exporter, outbox show."""
