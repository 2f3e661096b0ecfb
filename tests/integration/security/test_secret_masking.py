"""Passwords are hidden by where they stand (a DSN's password, a ``password=`` value), never by
replacing their text: whatever the password (``p``, ``e``, one equal to the user name, one full of
URL-special characters), what kstore prints and logs is the same, the password is not in it, and
no ordinary word is garbled."""

from __future__ import annotations

import re
import uuid
from typing import Any
from urllib.parse import quote

import pytest
import sqlalchemy as sa

from kstore import Settings
from tests.conftest import KAFKA_CLIENT, PG_DRIVER, PG_PASSWORD
from tests.integration.cli.test_cli import kstore
from tests.support.harness import WorkerProcess

#: One letter, a letter in nearly every word, a password equal to the user name, URL-special characters.
PASSWORDS = ["p", "e", "postgres", "p@ss:w/rd %#?&=;"]
#: What each of them is compared with: a password that appears in no message by chance.
REFERENCE = "Zq8-reference-Xv3"


def dsn(password: str, where: str = "127.0.0.1:1/nodb", user: str = "postgres") -> str:
    return f"postgresql+{PG_DRIVER}://{user}:{quote(password, safe='')}@{where}"


@pytest.mark.parametrize("args", [
    pytest.param(["migrate"], id="migrate-unreachable"),
    pytest.param(["worker", "processors:Recorder", "--topic", "t", "--bootstrap-servers", "127.0.0.1:1"],
                 id="worker-unreachable"),
    pytest.param(["worker", "nosuchmodule:Thing", "--topic", "t"], id="worker-import-error"),
])
def test_an_error_line_is_the_same_whatever_the_password(args: list[str]) -> None:
    """The database does not answer (or the processor cannot be imported): one line, the DSN in
    it with its password as ***, word for word the line any other password gets."""
    expected = kstore(*args, "--dsn", dsn(REFERENCE))
    assert expected.returncode == 2, expected.stderr
    assert REFERENCE not in expected.stderr
    for password in PASSWORDS:
        r = kstore(*args, "--dsn", dsn(password))
        assert (r.returncode, r.stderr) == (expected.returncode, expected.stderr), password
    if args[0] == "migrate":
        line = expected.stderr.strip()
        assert line.startswith(f"kstore: error: cannot migrate postgresql+{PG_DRIVER}://postgres:***@127.0.0.1:1/nodb: "
                               "connection"), line
        assert line.endswith('connection to server at "127.0.0.1", port 1 failed: Connection refused'), line


def test_a_malformed_dsn_is_the_same_line_whatever_the_password() -> None:
    expected = kstore("migrate", "--dsn", dsn(REFERENCE, where="127.0.0.1:port/db"))
    assert expected.returncode == 2
    assert expected.stderr.startswith("kstore: error: malformed DSN: expected a SQLAlchemy URL"), expected.stderr
    for password in PASSWORDS:
        r = kstore("migrate", "--dsn", dsn(password, where="127.0.0.1:port/db"))
        assert (r.returncode, r.stderr) == (expected.returncode, expected.stderr), password


def test_with_debug_the_traceback_has_no_password() -> None:
    password = PASSWORDS[-1]
    r = kstore("--debug", "migrate", "--dsn", dsn(password))
    assert "Traceback" in r.stderr
    assert password not in r.stderr and quote(password, safe="") not in r.stderr
    assert "Connection refused" in r.stderr


@pytest.fixture
def roles(postgresql_pw_proc: Any) -> dict[str, str]:
    """A login role per password on the server that checks passwords: password -> its DSN."""
    p = postgresql_pw_proc
    admin = sa.create_engine(f"postgresql+{PG_DRIVER}://{p.user}:{PG_PASSWORD}@{p.host}:{p.port}/postgres")
    found = {}
    with admin.begin() as conn:
        for password in [*PASSWORDS, REFERENCE]:
            user = f"postgres_{uuid.uuid4().hex[:8]}"
            # A role's password cannot be a bound parameter; these have no quote to double.
            conn.execute(sa.text(f"CREATE ROLE {user} LOGIN SUPERUSER PASSWORD '{password}'"))
            found[password] = dsn(password, where=f"{p.host}:{p.port}/postgres", user=user)
    admin.dispose()
    Settings(dsn=found[REFERENCE])  # well formed
    return found


def test_a_working_worker_logs_no_password(roles: dict[str, str], kafka: str, new_topic: Any,
                                           tmp_path: Any) -> None:
    """The worker's log (at DEBUG, the drivers' lines too) shows the DSN with *** for its password,
    and *** nowhere else: no word of any line is garbled."""
    assert kstore("migrate", "--dsn", roles[REFERENCE]).returncode == 0
    topic = new_topic(partitions=1)
    for password in PASSWORDS:
        url = roles[password]
        user = re.search(r"://([^:]+):", url)
        assert user is not None
        worker = WorkerProcess(["--log-level", "DEBUG", "worker", "processors:Recorder", "--dsn", url,
                                "--group", f"g-{uuid.uuid4().hex[:8]}", "--topic", topic,
                                "--bootstrap-servers", kafka],
                               {"KSTORE_KAFKA_CLIENT": KAFKA_CLIENT}, tmp_path / f"{user.group(1)}.log")
        try:
            worker.wait_for_log(r"claimed ")
            worker.terminate()
        finally:
            worker.cleanup()
        log = worker.log
        assert f"database postgresql+{PG_DRIVER}://{user.group(1)}:***@" in log, log
        assert log.count("***") == log.count(":***@"), [line for line in log.splitlines() if "***" in line]
        assert PASSWORDS[-1] not in log and quote(PASSWORDS[-1], safe="") not in log


