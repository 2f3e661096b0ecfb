"""The TLS PostgreSQL fixture: ``pg_tls_dsn`` connects with sslmode=verify-full, over TLS, to a
database prepared like ``pg_dsn``; a client trusting another CA is refused."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.conftest import PgTlsFiles


def test_verify_full_connection_uses_tls(pg_tls_dsn: str) -> None:
    engine = sa.create_engine(pg_tls_dsn)
    try:
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")) is True
            tables = set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert "kstore_offsets" in tables and "effects" in tables, tables


def test_verify_full_against_another_ca_is_refused(pg_tls_dsn: str, pg_tls_files: PgTlsFiles) -> None:
    url = make_url(pg_tls_dsn).update_query_dict({"sslrootcert": str(pg_tls_files.other_ca_file)})
    engine = sa.create_engine(url)
    try:
        with pytest.raises(sa.exc.OperationalError, match="certificate verify failed"):
            engine.connect().close()
    finally:
        engine.dispose()
