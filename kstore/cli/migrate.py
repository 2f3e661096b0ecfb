"""``kstore migrate``: parses its options, builds Settings and calls :func:`kstore.db.migration.upgrade`."""

from __future__ import annotations

import click

from kstore.cli.common import dsn_option, run
from kstore.db.migration import upgrade
from kstore.settings import Settings


@click.command()
@dsn_option
@click.option("--revision", default="head", show_default=True, help="Migrate to this revision.")
@click.pass_context
def migrate(ctx: click.Context, dsn: str | None, dsn_file: str | None, revision: str) -> None:
    """Create or upgrade kstore's tables (its own Alembic history, kstore_alembic_version)."""
    done = run(ctx, lambda: Settings.from_env(dsn=dsn, dsn_file=dsn_file), lambda s: upgrade(s, revision))
    click.echo(done.describe())
