"""kstore's own SQL literals (kstore.db.literals) without a database: which row templates it
leaves to the driver. Its literals against the drivers' own, on a real PostgreSQL:
tests/integration/database/test_literals.py."""

from __future__ import annotations

import pytest

from kstore.db import literals


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_template_with_a_percent_sign_of_its_own_is_left_to_the_driver(driver: str) -> None:
    assert literals.RowFormat.of("(%(a)s, 5 % 2)", driver) is None
    assert literals.RowFormat.of("(%(a)s, %s)", driver) is None
    assert literals.RowFormat.of("(%(a)s, %(b)b)", driver) is None  # psycopg 3's binary placeholder
    assert literals.RowFormat.of("(%(a)s, '5%%')", driver) is not None
