"""Secured clusters, and secrets and message contents kept out of logs."""
