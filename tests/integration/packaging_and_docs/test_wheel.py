"""The promised layout and install: the Alembic scripts at the top (`migrations/`, which `alembic -c
alembic.ini` uses), shipped inside the wheel; the development broker not in it, but a distribution of
its own (devbroker/) that builds alone; no PostgreSQL driver in the wheel's dependencies, one
per extra (`kstore[psycopg2]`, `kstore[psycopg]`); the wheel, installed outside the checkout, runs
on SQLite with no driver at all, runs a pipeline on PostgreSQL with either driver alone, and says in
one line which extra to install when the DSN's driver is missing.

A driver is made "not installed" by a module of its name, first on the path, that raises
ModuleNotFoundError as a missing one does: the test's own virtualenv has both.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import kstore
from tests.support.harness import REPO_DIR

DRIVERS = ("psycopg2", "psycopg")

#: A pipeline run by the installed wheel: consume a topic until idle, counting each value, a batch's
#: counts sent as one upsert per batch as the demo's page-view counter does (on psycopg 3 an
#: executemany, in pipeline mode).
PIPELINE = """
import sys
from collections import Counter
from sqlalchemy import text
from kstore import Processor, Settings, Worker, migrate

class Count(Processor):
    value_format = "str"

    def handle_batch(self, msgs):
        counts = Counter(m.value for m in msgs)
        self.session.execute(text("INSERT INTO seen (v, n) VALUES (:v, :n) "
                                  "ON CONFLICT (v) DO UPDATE SET n = seen.n + excluded.n"),
                             [{"v": v, "n": n} for v, n in counts.items()])

dsn, servers, topic = sys.argv[1:]
settings = Settings(dsn=dsn, bootstrap_servers=servers, group="wheel", topics=(topic,),
                    session_timeout_ms=6000, heartbeat_interval_ms=1000)
migrate(settings)
Worker(Count(), settings).run(idle_timeout=2)
"""


def run(*args: str, cwd: Path, env: dict[str, str] | None = None, code: int = 0) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == code, f"{args}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


def tables(dsn: str) -> set[str]:
    engine = sa.create_engine(dsn)
    try:
        return {t for t in sa.inspect(engine).get_table_names() if t.startswith("kstore_")}
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the checkout without its build outputs: setuptools would otherwise
    reuse a stale build/lib left by an earlier build, modules since removed included."""
    source = tmp_path_factory.mktemp("source") / "kstore"
    shutil.copytree(REPO_DIR, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", ".kstore-dev", "*.db"))
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source), cwd=dist)
    (built,) = dist.glob("kstore-*.whl")
    return built


@dataclass(frozen=True)
class Installed:
    """The wheel installed (without its dependencies, which the test's virtualenv has) in a folder
    of its own, and one folder per driver holding a package of its name that is "not installed"."""

    site: Path
    masks: Path

    def env(self, *without: str) -> dict[str, str]:
        """The environment that runs the installed wheel, with the drivers named hidden."""
        return {"PYTHONPATH": os.pathsep.join([*(str(self.masks / d) for d in without), str(self.site)])}


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    site = tmp_path_factory.mktemp("site")
    run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel), cwd=site)
    masks = tmp_path_factory.mktemp("masks")
    for driver in DRIVERS:
        (masks / driver / driver).mkdir(parents=True)
        (masks / driver / driver / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{driver}'\", name={driver!r})\n")
    return Installed(site, masks)


def test_the_wheel_ships_the_migrations_and_no_driver(wheel: Path, installed: Installed, tmp_path: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kstore/migrations/env.py", "kstore/migrations/script.py.mako",
            "kstore/migrations/versions/0001_offsets.py", "kstore/py.typed"} <= names
    assert not any(n.startswith("migrations/") for n in names)
    assert wheel.name.startswith(f"kstore-{kstore.__version__}-")

    env = installed.env()
    where = run(sys.executable, "-c", "import kstore, kstore.db.migration as m; print(kstore.__file__); "
                "print(m.script_location())", cwd=tmp_path, env=env).stdout.split()
    assert all(Path(p).is_relative_to(installed.site) for p in where), where  # the wheel's copy, not the checkout's

    requires = run(sys.executable, "-c", "import importlib.metadata as m; print('\\n'.join(m.requires('kstore')))",
                   cwd=tmp_path, env=env).stdout.splitlines()

    def needs(extra: str | None) -> set[str]:
        marker = f'extra == "{extra}"'
        chosen = [r for r in requires if (marker in r if extra else "extra ==" not in r)]
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in chosen}

    assert not needs(None) & {"psycopg2", "psycopg2-binary", "psycopg", "psycopg-binary"}, requires
    assert needs("psycopg2") == {"psycopg2"}  # built from source: not the -binary wheel
    assert needs("psycopg") == {"psycopg"}
    assert {"psycopg2-binary", "psycopg"} <= needs("test")
    # The default Kafka client is a dependency, the other an extra; each is named by an extra.
    assert "confluent-kafka" in needs(None) and not needs(None) & {"kafka-python", "crc32c"}, requires
    assert needs("kafka-python") == {"kafka-python", "crc32c"}
    assert needs("confluent") == {"confluent-kafka"}


def test_the_wheel_ships_no_development_broker(wheel: Path) -> None:
    """The development broker (it fetches Kafka's jars with Maven and runs JVMs) is a distribution of
    its own: no module of it, and no code that runs Maven or a JVM, is in kstore's wheel."""
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    broker_files = [n for n in names if n.startswith(("devbroker/kstore_devbroker/", "kstore_devbroker/"))
                    or n in {"kstore/devbroker.py", "kstore/dev.py"} or n.endswith((".jar", "pom.xml"))]
    assert not broker_files, broker_files
    runs_a_jvm = [n for n in names if n.endswith(".py")
                  and re.search(r"\bmvn\b|org\.apache\.kafka|\bjava\b", archive.read(n).decode())]
    assert not runs_a_jvm, runs_a_jvm
    top_level = {n.split("/", 1)[0] for n in names if not n.startswith(f"kstore-{kstore.__version__}.dist-info/")}
    assert top_level == {"kstore"}, top_level


def test_the_development_broker_builds_and_runs_on_its_own(tmp_path: Path) -> None:
    """devbroker/ alone, copied out of the checkout, builds the kstore-devbroker wheel: its package, its
    command (`python -m kstore_devbroker`), confluent-kafka as its one dependency; installed, it runs
    without kstore."""
    source = shutil.copytree(REPO_DIR / "devbroker", tmp_path / "devbroker",
                             ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source), cwd=tmp_path)
    (built,) = dist.glob("kstore_devbroker-*.whl")
    names = set(zipfile.ZipFile(built).namelist())
    assert {"kstore_devbroker/__init__.py", "kstore_devbroker/__main__.py", "kstore_devbroker/broker.py",
            "kstore_devbroker/certs.py", "kstore_devbroker/py.typed"} <= names, names
    assert not any(n.startswith("kstore/") for n in names), names

    site = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(built), cwd=tmp_path)
    env = {"PYTHONPATH": str(site)}
    requires = run(sys.executable, "-c", "import importlib.metadata as m; print('\\n'.join(m.requires("
                   "'kstore-devbroker')))", cwd=tmp_path, env=env).stdout.split()
    assert [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requires] == ["confluent-kafka"], requires
    # The installed copy, not the checkout's, and no kstore module imported along the way.
    check = ("import sys, kstore_devbroker.broker as b; print(b.__file__); "
             "print(sorted(m for m in sys.modules if m == 'kstore' or m.startswith('kstore.')))")
    where, kstore_modules = run(sys.executable, "-c", check, cwd=tmp_path, env=env).stdout.splitlines()
    assert Path(where).is_relative_to(site) and kstore_modules == "[]", (where, kstore_modules)
    usage = run(sys.executable, "-m", "kstore_devbroker", "--help", cwd=tmp_path, env=env).stdout
    assert usage.startswith("usage: python -m kstore_devbroker") and "fetch" in usage and "stop" in usage, usage


def test_with_no_driver_sqlite_runs_and_postgresql_names_the_extra(installed: Installed, postgresql: Any,
                                                                   tmp_path: Path) -> None:
    """A bare `pip install kstore`: the embedded SQLite default works; a PostgreSQL DSN is one line,
    exit 2, naming the extra that installs its driver."""
    env = installed.env(*DRIVERS)
    run(sys.executable, "-c", "import kstore, kstore.cli", cwd=tmp_path, env=env)
    out = run(sys.executable, "-m", "kstore", "migrate", cwd=tmp_path, env=env).stdout  # the default DSN
    assert "kstore tables created: migrated from none to head" in out and (tmp_path / "kstore.db").exists()
    info = postgresql.info
    for driver, extra in (("psycopg2", "kstore[psycopg2]"), ("psycopg", "kstore[psycopg]")):
        dsn = f"postgresql+{driver}://{info.user}:s3cret@{info.host}:{info.port}/{info.dbname}"
        r = run(sys.executable, "-m", "kstore", "migrate", "--dsn", dsn, cwd=tmp_path, env=env, code=2)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kstore: error: cannot use DSN"), r.stderr
        assert f"its driver {driver} is not installed: pip install '{extra}'" in lines[0]
        assert "s3cret" not in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("driver", DRIVERS)
def test_either_driver_alone_runs_a_pipeline_on_postgresql(driver: str, installed: Installed, postgresql: Any,
                                                           kafka: str, new_topic: Any, produce: Any,
                                                           tmp_path: Path) -> None:
    """`pip install kstore[psycopg]` with no psycopg2 at all (and the other way round) migrates and
    runs a pipeline on PostgreSQL; the other driver's DSN names its extra."""
    other = next(d for d in DRIVERS if d != driver)
    env = installed.env(other)
    info = postgresql.info
    dsn = f"postgresql+{driver}://{info.user}@{info.host}:{info.port}/{info.dbname}"
    engine = sa.create_engine(dsn)  # this process has both drivers
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE seen (v TEXT PRIMARY KEY, n INTEGER NOT NULL)"))
    topic = new_topic(partitions=2)
    produce(topic, (f"v{i}" for i in range(200)))
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    run(sys.executable, "pipeline.py", dsn, kafka, topic, cwd=tmp_path, env=env)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*), sum(n) FROM seen")).one() == (200, 200)
        assert {"kstore_offsets", "kstore_dead_letters", "kstore_alembic_version"} <= tables(dsn)
    finally:
        engine.dispose()
    r = run(sys.executable, "-m", "kstore", "migrate", "--dsn", dsn.replace(driver, other, 1), cwd=tmp_path,
            env=env, code=2)
    assert f"its driver {other} is not installed: pip install 'kstore[{other}]'" in r.stderr


def test_alembic_with_the_checkouts_ini_uses_the_top_level_migrations(tmp_path: Path) -> None:
    assert (REPO_DIR / "migrations" / "env.py").is_file() and not (REPO_DIR / "kstore" / "migrations").exists()
    run(str(Path(sys.executable).with_name("alembic")), "-c", str(REPO_DIR / "alembic.ini"), "upgrade", "head",
        cwd=tmp_path)
    assert {"kstore_offsets", "kstore_alembic_version"} <= tables(f"sqlite:///{tmp_path / 'kstore.db'}")
