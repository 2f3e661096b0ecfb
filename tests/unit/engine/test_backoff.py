"""The worker's outage backoff: what it waits, and which dependency /readyz names."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy.exc import OperationalError

from kstore.engine.backoff import Backoff
from kstore.errors import BrokerError


def test_the_delay_doubles_to_its_longest_and_a_success_starts_it_again() -> None:
    backoff = Backoff(0.5, 2.0)
    waits = [backoff.failed("claim", OperationalError("SELECT", {}, Exception("gone"))) for _ in range(4)]
    assert waits == [0.5, 1.0, 2.0, 2.0]
    assert backoff.failing and not backoff.ready()
    backoff.succeeded()
    assert not backoff.failing and backoff.ready() and backoff.delay == 0.5


def test_a_broker_that_does_not_answer_is_named_as_the_brokers_not_the_database(
        caplog: pytest.LogCaptureFixture) -> None:
    database_errors: list[None] = []
    backoff = Backoff(0.5, 10.0, on_failure=lambda: database_errors.append(None))
    with caplog.at_level(logging.WARNING):
        backoff.failed("claim t[0] (they stay paused)", BrokerError("cannot read the log bounds of 1 partition(s)"))
    assert backoff.away == "the Kafka brokers are not answering"
    assert database_errors == []  # kstore_database_errors counts the database's failures only
    assert "Kafka error, could not claim t[0] (they stay paused): cannot read the log bounds" in caplog.text
    backoff.failed("claim t[0] (they stay paused)", OperationalError("SELECT", {}, Exception("gone")))
    assert backoff.away == "the database is not answering"
    assert len(database_errors) == 1
    assert "database error, could not claim t[0]" in caplog.text
