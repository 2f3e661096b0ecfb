"""kstore.testing: a user's processor tested without Kafka (the page-view example)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from kstore import DeserializationError, Reject
from kstore.testing import make_message, run_batch
from tests.support.processors import Validating
from tests.support.processors import metadata as effects_metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
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


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    """An engine with the tests' effects table, on SQLite or on the real PostgreSQL."""
    url = f"sqlite:///{tmp_path / 't.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_dsn")
    eng = sa.create_engine(url)
    effects_metadata.create_all(eng)
    yield eng
    eng.dispose()


def test_raw_messages_are_deserialized_and_a_bad_payload_is_rejected(engine: sa.Engine) -> None:
    msgs = [make_message(b'{"page": "/"}', raw=True), make_message(b"{oops", raw=True, offset=1),
            make_message(b'{"page": "/"}', raw=True, offset=2)]
    with pytest.raises(DeserializationError, match="JSONDecodeError"):  # on_error="stop", the processor's
        run_batch(PageViewCounter(), msgs, engine)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT COUNT(*) FROM page_views")).scalar_one() == 0

    outcome = run_batch(PageViewCounter(), msgs, engine, on_error="dead_letter")
    assert [(m.offset, m.value) for m in outcome.committed] == [(0, {"page": "/"}), (2, {"page": "/"})]
    (rejected,) = outcome.rejected
    assert rejected.message.offset == 1 and rejected.message.value == b"{oops"
    assert isinstance(rejected.error, DeserializationError) and isinstance(rejected.error.__cause__, ValueError)
    with engine.connect() as conn:
        assert dict(conn.execute(sa.text("SELECT page, views FROM page_views")).all()) == {"/": 2}
    with pytest.raises(TypeError, match="must be bytes or None"):
        make_message({"page": "/"}, raw=True)


def test_rejected_messages_come_back_with_their_errors_and_the_rest_commits(engine: sa.Engine) -> None:
    values = ["ok0", "bad1", "ok2", "late-bad3", "ok4"]
    msgs = [make_message(v, offset=i) for i, v in enumerate(values)]
    with pytest.raises(Reject, match="invalid value 'bad1'"):  # on_error="stop": as the worker, it stops
        run_batch(Validating(), msgs, engine)
    outcome = run_batch(Validating(), msgs, engine, on_error="dead_letter")
    assert [m.offset for m in outcome.committed] == [0, 2, 4]
    assert [(r.message.offset, type(r.error).__name__, str(r.error)) for r in outcome.rejected] == [
        (1, "Reject", "invalid value 'bad1'"), (3, "Reject", "found invalid after writing: 'late-bad3'")]
    with engine.connect() as conn:  # the late rejection's own write was rolled back
        assert sorted(conn.execute(sa.text("SELECT kafka_offset FROM effects")).scalars()) == [0, 2, 4]
    # An error the worker would retry is raised, and nothing of the batch commits.
    with pytest.raises(ValueError, match="cannot parse 'flaky'"):
        run_batch(Validating(), [make_message("ok9", offset=9), make_message("flaky", offset=10)], engine,
                  on_error="dead_letter")
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.text("SELECT kafka_offset FROM effects")).scalars()) == [0, 2, 4]


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
    examples = Path(__file__).resolve().parents[2] / "examples"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-q",
                        "--rootdir", str(tmp_path), "-c", os.devnull,
                        # Its own basetemp: a run in /tmp/pytest-of-<user> would prune the numbered
                        # directories of the session running it, PostgreSQL's data among them.
                        "--basetemp", str(tmp_path / "basetemp"), str(tmp_path / "test_users.py")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(examples)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "warning" not in r.stdout, r.stdout
