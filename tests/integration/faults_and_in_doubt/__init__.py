"""Crashes, zombies, outages, lost COMMIT answers and silent databases: each effect lands once."""
