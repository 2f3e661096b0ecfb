"""One processor ``setup()`` at a time per group (kstore.db.setuplock): the advisory lock's key.
The lock held on a real PostgreSQL: tests/integration/worker/test_processor_setup.py."""

from __future__ import annotations

from kstore.db.setuplock import setup_lock_key


def test_lock_keys_are_stable_and_per_group() -> None:
    """The key is the same in every process (Python's own hash() is salted per process)."""
    assert setup_lock_key("orders") == setup_lock_key("orders")
    assert setup_lock_key("orders") != setup_lock_key("payments")
    assert setup_lock_key("orders") == 5597808321461304479  # fixed: workers of two releases agree
    assert -(2**63) <= setup_lock_key("x" * 1000) < 2**63
