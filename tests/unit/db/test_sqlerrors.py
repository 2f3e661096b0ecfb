"""How kstore classes a database error (kstore.db.sqlerrors), by its SQLSTATE: an outage (transient),
a database that answers yet cannot take the batch (database_state), or what a batch did.
The same classes on real PostgreSQL errors: tests/integration/database/test_db_connections.py."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import OperationalError

from kstore.db.sqlerrors import database_state, transient


def _pg_error(code: str) -> OperationalError:
    class Orig(Exception):
        pgcode = code

    return OperationalError("stmt", {}, Orig(f"error {code}"))


@pytest.mark.parametrize("code", ["25006", "57014", "57P01", "57P03", "25P03", "58030", "40001", "53300"])
def test_failovers_shutdowns_and_cancels_are_the_databases_not_a_messages(code: str) -> None:
    """A read-only transaction (the DSN now leads to a replica), an admin shutdown, a cancelled
    statement: an outage, never a bad message (on_error=stop would halt the pipeline, dead_letter
    would dead-letter good messages)."""
    assert transient(_pg_error(code))


@pytest.mark.parametrize("code", ["23505", "23502", "42P01", "42601", "22P02"])
def test_what_a_batch_did_is_not_transient(code: str) -> None:
    assert not transient(_pg_error(code))


@pytest.mark.parametrize("code", ["25006", "53100", "40001", "40P01", "55P03"])
def test_a_read_only_or_full_or_contended_database_is_never_taken_for_a_batchs_failure(code: str) -> None:
    """It answers a probe, yet no batch is to blame: never narrowed down to a message."""
    assert database_state(_pg_error(code))


@pytest.mark.parametrize("code", ["57014", "57P01", "08006", "25P03"])
def test_a_cut_or_cancelled_session_may_be_the_batchs_own_doing(code: str) -> None:
    assert not database_state(_pg_error(code))
