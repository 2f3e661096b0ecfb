"""kstore.testing: a user's processor tested without Kafka (the page-view example)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from kstore.testing import make_message, run_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from pageviews import PageViewCounter


def test_run_batch_commits_the_processors_writes(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    counter = PageViewCounter()
    run_batch(counter, [make_message({"page": "/"}), make_message({"page": "/a"}, offset=1),
                        make_message({"page": "/"}, offset=2)], engine)
    run_batch(counter, [make_message({"page": "/"}, offset=3)], engine)
    with engine.connect() as conn:
        assert dict(conn.execute(sa.text("SELECT page, views FROM page_views")).all()) == {"/": 3, "/a": 1}


def test_run_batch_rolls_back_when_the_processor_raises(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    counter = PageViewCounter()
    with pytest.raises(KeyError):
        run_batch(counter, [make_message({"page": "/"}), make_message({"no page": 1}, offset=1)], engine)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT COUNT(*) FROM page_views")).scalar_one() == 0


USERS_TEST = '''
import sqlalchemy as sa

from kstore.testing import make_message, run_batch
from pageviews import PageViewCounter


def test_counts(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    run_batch(PageViewCounter(), [make_message({"page": "/"})], engine)
'''


def test_a_users_test_run_sees_no_warning_from_kstore(tmp_path: Path) -> None:
    """A user's own pytest run (none of kstore's settings) that imports kstore: no warning, not
    even the DeprecationWarnings kafka-python's own import raises on Python 3.11 and 3.12."""
    (tmp_path / "test_users.py").write_text(USERS_TEST)
    examples = Path(__file__).resolve().parents[1] / "examples"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-q",
                        "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_users.py")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(examples)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "warning" not in r.stdout, r.stdout
