"""No message contents in the logs: a statement the database refuses is logged without the values
bound to it (SQLAlchemy's ``[parameters: ...]``, the server's ``Failing row contains ...``), unless
``log_statement_parameters`` is turned on to debug. The dead letter keeps the whole error: it is in
the database, beside the message itself."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Settings
from kstore.db.store import make_engine
from tests.integration.failures_and_dead_letters.test_failures import dead_letter_rows
from tests.support.harness import wait_until

#: The value of the message whose row the database refuses (a NOT NULL column left empty).
CARD = "secret-card-4111"


@pytest.mark.integration
@pytest.mark.parametrize("write", ["insert", "text"])
def test_a_refused_write_is_logged_without_the_message_values(pg_dsn: str, new_topic: Any, produce: Any,
                                                               workers: Any, write: str) -> None:
    topic = new_topic(1)
    produce(topic, [f"a{i}" for i in range(5)] + [CARD] + [f"b{i}" for i in range(5)])
    w = workers(pg_dsn, topic, f"hidden-{write}", env={"KSTORE_TEST_DB_POISON": CARD, "KSTORE_TEST_WRITE": write},
                args=["--on-error", "dead_letter", "--max-attempts", "2"])
    wait_until(lambda: dead_letter_rows(pg_dsn), 60, what="the refused message dead-lettered")
    assert w.terminate() == 0
    log = w.log
    assert "NotNullViolation" in log or "not-null constraint" in log, log[-4000:]
    assert CARD not in log, [line for line in log.splitlines() if CARD in line]
    (row,) = dead_letter_rows(pg_dsn)
    assert "NotNullViolation" in row.error


@pytest.mark.integration
def test_a_worker_stopped_by_a_refused_write_says_why_without_the_values(pg_dsn: str, new_topic: Any, produce: Any,
                                                                        workers: Any) -> None:
    """on_error=stop: the worker's last line names the error, not the values of the row it refused."""
    topic = new_topic(1)
    produce(topic, ["a0", CARD, "b0"])
    w = workers(pg_dsn, topic, "stopped", env={"KSTORE_TEST_DB_POISON": CARD},
                args=["--on-error", "stop", "--max-attempts", "1"])
    assert w.wait() == 1
    last = w.log.strip().splitlines()[-1]
    assert last.startswith("kstore: error: processor Recorder failed on") and "NotNullViolation" in last, last
    assert CARD not in w.log, [line for line in w.log.splitlines() if CARD in line]


@pytest.mark.integration
def test_log_statement_parameters_shows_them_for_debugging(pg_dsn: str, new_topic: Any, produce: Any,
                                                           workers: Any) -> None:
    topic = new_topic(1)
    produce(topic, ["a0", CARD, "b0"])
    w = workers(pg_dsn, topic, "shown", env={"KSTORE_TEST_DB_POISON": CARD, "KSTORE_LOG_STATEMENT_PARAMETERS": "true"},
                args=["--on-error", "dead_letter", "--max-attempts", "2"])
    wait_until(lambda: dead_letter_rows(pg_dsn), 60, what="the refused message dead-lettered")
    assert w.terminate() == 0
    assert CARD in w.log


@pytest.mark.parametrize("statement", [
    pytest.param("SELECT CAST(:v AS integer)", id="data-exception"),  # the server quotes the value it refused
    pytest.param("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                 "VALUES (NULL, 0, 0, :v, 'w')", id="not-null"),  # DETAIL: Failing row contains (...)
])
def test_a_database_error_for_a_log_line_holds_no_value(pg_dsn: str, statement: str) -> None:
    from kstore.db.sqlerrors import error_text

    engine = make_engine(Settings(dsn=pg_dsn))
    try:
        with pytest.raises(sa.exc.DBAPIError) as raised, engine.begin() as conn:
            conn.execute(sa.text(statement), {"v": CARD})
    finally:
        engine.dispose()
    assert CARD in f"{raised.value.orig}"  # the driver's own text has it
    text = error_text(raised.value)
    assert CARD not in text and "\n" not in text, text
    assert text.startswith(("DataError: (", "IntegrityError: (")), text
    assert CARD in error_text(raised.value, statement_parameters=True)
