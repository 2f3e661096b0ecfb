"""The console's unit fixtures: a seeded SQLite database, and a console on it to log in to or read only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.support.console_pages import PASSWORD, console_client, seeded_dsn


@pytest.fixture
def dsn(tmp_path: Path) -> str:
    return seeded_dsn(tmp_path)


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    with console_client(dsn, console_password=PASSWORD) as found:
        yield found


@pytest.fixture
def read_only(dsn: str) -> Iterator[TestClient]:
    with console_client(dsn, console_read_only=True) as found:
        yield found
