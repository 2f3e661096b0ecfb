"""The promised layout: the Alembic scripts at the top (`migrations/`, which `alembic -c alembic.ini`
uses), shipped inside the wheel; the wheel, installed outside the checkout, migrates PostgreSQL and
SQLite."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .harness import REPO_DIR


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{args}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


def tables(dsn: str) -> set[str]:
    engine = sa.create_engine(dsn)
    try:
        return {t for t in sa.inspect(engine).get_table_names() if t.startswith("kstore_")}
    finally:
        engine.dispose()


def test_the_wheel_installed_outside_the_checkout_migrates_both_databases(tmp_path: Path, postgresql: Any) -> None:
    dist, site, work = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    work.mkdir()
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
        str(REPO_DIR), cwd=tmp_path)
    (wheel,) = dist.glob("kstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kstore/migrations/env.py", "kstore/migrations/script.py.mako",
            "kstore/migrations/versions/0001_offsets.py"} <= names
    assert not any(n.startswith("migrations/") for n in names)
    run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel), cwd=tmp_path)

    env = {"PYTHONPATH": str(site)}
    where = run(sys.executable, "-c", "import kstore, kstore.db.migration as m; print(kstore.__file__); "
                "print(m.script_location())", cwd=work, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # the wheel's copy, not the checkout's

    info = postgresql.info
    pg = f"postgresql+psycopg2://{info.user}@{info.host}:{info.port}/{info.dbname}"
    lite = f"sqlite:///{work / 'kstore.db'}"
    for dsn in (pg, lite):
        out = run(sys.executable, "-m", "kstore", "migrate", "--dsn", dsn, cwd=work, env=env).stdout
        assert "kstore tables created: migrated from none to head" in out
        assert {"kstore_offsets", "kstore_dead_letters", "kstore_alembic_version"} <= tables(dsn)


def test_alembic_with_the_checkouts_ini_uses_the_top_level_migrations(tmp_path: Path) -> None:
    assert (REPO_DIR / "migrations" / "env.py").is_file() and not (REPO_DIR / "kstore" / "migrations").exists()
    run(str(Path(sys.executable).with_name("alembic")), "-c", str(REPO_DIR / "alembic.ini"), "upgrade", "head",
        cwd=tmp_path)
    assert {"kstore_offsets", "kstore_alembic_version"} <= tables(f"sqlite:///{tmp_path / 'kstore.db'}")
