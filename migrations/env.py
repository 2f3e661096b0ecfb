"""Alembic environment for kstore's own tables.

The table prefix and schema come from the Alembic config's attributes (set by
:func:`kstore.db.migration.alembic_config`), or from ``kstore_table_prefix`` /
``kstore_schema`` main options when run through ``alembic.ini``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

config = context.config
prefix = config.attributes.get("table_prefix") or config.get_main_option("kstore_table_prefix") or "kstore_"
schema = config.attributes.get("schema") or config.get_main_option("kstore_schema") or None


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    assert url, "set sqlalchemy.url (kstore migrate --dsn does this)"
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        version_table=f"{prefix}alembic_version",
        version_table_schema=schema,
        # kstore's history is its own; never look at or touch the user's tables.
        include_object=lambda obj, name, type_, reflected, compare_to: bool(name and name.startswith(prefix)),
    )
    with context.begin_transaction():
        context.run_migrations(table_prefix=prefix, schema=schema)


run_migrations()
