"""The worker and the processor it runs: batches, hooks, signals, setup, async handlers."""
