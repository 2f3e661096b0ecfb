"""The database side's fast paths against the plain ones, on a real PostgreSQL and both drivers."""
