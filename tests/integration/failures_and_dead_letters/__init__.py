"""Messages that fail: retries, rejects, isolation, dead letters and their commands."""
