"""Small things a new user meets in the first hour: the version, a `postgres://` DSN, a
processor given as a file path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kstore import Settings, load_processor


def test_version() -> None:
    r = subprocess.run([sys.executable, "-m", "kstore", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kstore ") and r.stdout.split()[1][0].isdigit()


def test_a_postgres_scheme_dsn_is_understood() -> None:
    assert Settings(dsn="postgres://u:pw@db:5432/app").dsn == "postgresql://u:pw@db:5432/app"
    assert Settings(dsn="postgres+psycopg2://u@db/app").dsn == "postgresql+psycopg2://u@db/app"


def test_a_processor_given_as_a_file_path(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "rules.py").write_text("LIMIT = 10\n")
    (app / "ledger.py").write_text(
        "from kstore import Processor\nfrom rules import LIMIT\n\n"
        "class Ledger(Processor):\n    group = 'ledger'\n    topics = ['transfers']\n    limit = LIMIT\n\n"
        "    def handle(self, msg):\n        pass\n")
    processor = load_processor(f"{app / 'ledger.py'}:Ledger")
    assert type(processor).__name__ == "Ledger" and processor.limit == 10  # type: ignore[attr-defined]
