"""The relay's librdkafka lines: a transaction coordinator that is not ready yet (every relay's first
start on a fresh broker meets "Coordinator load in progress"), which librdkafka retries by itself,
is INFO, not a WARNING; other warnings stay warnings. The lines are fabricated as confluent-kafka
hands them to a ``logger``: ``log(level, "%s [%s] %s", facility, client name, text)``."""

from __future__ import annotations

import logging

import pytest

from kstore.kafka.confluent.producer import _TransactionLog

LOGGER = "kstore.kafka.confluent.producer"


def line(facility: str, text: str, level: int = logging.WARNING) -> tuple[int, str, str, str, str]:
    return (level, "%s [%s] %s", facility, "rdkafka#producer-2", f"[thrd:main]: {text}")


@pytest.mark.parametrize("answer", [
    "Broker: Coordinator load in progress",
    "Broker: Coordinator not available",
    "Broker: Not coordinator",
])
def test_a_coordinator_not_ready_is_info(answer: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    _TransactionLog().log(*line("GETPID", "Failed to acquire transactional PID from broker TxnCoordinator/1: "
                                          f"{answer}: retrying"))
    (record,) = caplog.records
    assert (record.name, record.levelno) == (LOGGER, logging.INFO)
    assert record.getMessage() == ("GETPID [rdkafka#producer-2] [thrd:main]: Failed to acquire transactional PID "
                                   f"from broker TxnCoordinator/1: {answer}: retrying")


def test_other_lines_keep_their_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    log = _TransactionLog()
    log.log(*line("GETPID", "Failed to acquire transactional PID from broker TxnCoordinator/1: "
                            "Broker: Transactional Id authorization failed"))
    log.log(*line("TXNERR", "Fatal transaction error: Broker: Coordinator load in progress", logging.ERROR))
    log.log(*line("CONFWARN", "Configuration property fetch.wait.max.ms is a consumer property and will be "
                              "ignored by this producer instance"))
    log.log(*line("INIT", "Producer 100% initialised", logging.DEBUG))
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.ERROR, logging.WARNING, logging.DEBUG]
