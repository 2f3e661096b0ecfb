"""Where a partition starts and moves: resets, start_from, positions leaving the log, the mirror."""
