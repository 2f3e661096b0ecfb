"""Bad configuration gets one clear line on stderr, a non-zero exit, no traceback, no password."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from kstore import __version__
from tests.support.harness import REPO_DIR, SUPPORT_DIR

PASSWORD = "s3cret-Pa55word"


def kstore(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kstore", *args], capture_output=True, text=True, timeout=timeout, cwd=SUPPORT_DIR,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(SUPPORT_DIR), str(REPO_DIR))),
             "KSTORE_CONNECT_TIMEOUT_S": "3", **(env or {})},
    )


def assert_one_clear_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith("kstore: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert "Traceback" not in result.stderr + result.stdout
    assert PASSWORD not in result.stderr + result.stdout


def test_unreachable_database(kafka: str, new_topic: Any) -> None:
    topic = new_topic(partitions=1)
    dsn = f"postgresql+psycopg2://kstore:{PASSWORD}@127.0.0.1:1/nodb"
    r = kstore("worker", "processors:Recorder", "--dsn", dsn, "--bootstrap-servers", kafka, "--topic", topic)
    assert_one_clear_line(r, "cannot connect to database", "127.0.0.1:1/nodb", "***")


def test_wrong_password_is_never_printed(postgresql_pw_proc: Any) -> None:
    """Even when the server itself reports the failure, the password stays out of the output: a
    server that checks passwords (a trust-auth server would never look at it), an unknown user."""
    p = postgresql_pw_proc
    dsn = f"postgresql+psycopg2://nosuchuser:{PASSWORD}@{p.host}:{p.port}/postgres"
    r = kstore("migrate", "--dsn", dsn)
    assert_one_clear_line(r, 'password authentication failed for user "nosuchuser"')


def test_wrong_password_against_a_server_that_checks_it(postgresql_pw_proc: Any) -> None:
    """A server with password authentication: the right password migrates; a wrong one
    gets one clear line, and neither password appears in the output."""
    from tests.conftest import PG_PASSWORD

    p = postgresql_pw_proc
    base = f"{p.host}:{p.port}/postgres"
    ok = kstore("migrate", "--dsn", f"postgresql+psycopg2://{p.user}:{PG_PASSWORD}@{base}")
    assert ok.returncode == 0, ok.stderr
    assert PG_PASSWORD not in ok.stdout + ok.stderr
    r = kstore("migrate", "--dsn", f"postgresql+psycopg2://{p.user}:{PASSWORD}@{base}")
    assert_one_clear_line(r, "password authentication failed")
    assert PG_PASSWORD not in r.stdout + r.stderr


def test_malformed_dsn() -> None:
    r = kstore("migrate", "--dsn", "not a url")
    assert_one_clear_line(r, "malformed DSN")


def test_unknown_processor(sqlite_dsn: str, kafka: str) -> None:
    r = kstore("worker", "nosuchmodule:Thing", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "cannot import processor module 'nosuchmodule'")
    r = kstore("worker", "processors:NoSuchClass", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "has no 'NoSuchClass'")
    r = kstore("worker", "processors:effects", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "not a kstore.Processor subclass")
    r = kstore("worker", "processors", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "MODULE:CLASS")


def test_a_syntax_error_in_the_processor_names_its_file_and_line(tmp_path: Path, sqlite_dsn: str,
                                                               kafka: str) -> None:
    """A processor file that does not parse is bad configuration (exit 2) like any other import
    error: one line with the file and the line to fix, as a file given by path or as a module."""
    (tmp_path / "broken_pipeline.py").write_text("from kstore import Processor\n\nclass Orders(Processor)\n    pass\n")
    r = kstore("worker", f"{tmp_path / 'broken_pipeline.py'}:Orders", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "cannot import processor module", "broken_pipeline.py, line 3", "expected ':'")
    r = kstore("worker", "broken_pipeline:Orders", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka,
               env={"PYTHONPATH": str(tmp_path)})
    assert_one_clear_line(r, "cannot import processor module 'broken_pipeline'", "broken_pipeline.py, line 3")


def test_a_mistyped_processor_class_gets_a_suggestion(sqlite_dsn: str, kafka: str) -> None:
    r = kstore("worker", "processors:Recoder", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "has no 'Recoder'; did you mean 'Recorder'?")
    r = kstore("worker", "processors:failingsetup", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "did you mean 'FailingSetup'?")
    r = kstore("worker", "processors:Zzzzzz", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka)
    assert_one_clear_line(r, "has no 'Zzzzzz' (its Processor classes: ", "Recorder")


def test_tables_not_migrated(tmp_path: Path, kafka: str, new_topic: Any) -> None:
    topic = new_topic(partitions=1)
    dsn = f"sqlite:///{tmp_path / 'empty.db'}"
    r = kstore("worker", "processors:Recorder", "--dsn", dsn, "--bootstrap-servers", kafka, "--topic", topic)
    assert_one_clear_line(r, "has no kstore tables", "kstore migrate")


def test_unreachable_brokers(sqlite_dsn: str) -> None:
    r = kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--bootstrap-servers", "127.0.0.1:1",
               "--topic", "t")
    assert_one_clear_line(r, "cannot reach Kafka at 127.0.0.1:1")


def test_unknown_topic(sqlite_dsn: str, kafka: str) -> None:
    r = kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--bootstrap-servers", kafka,
               "--topic", "no-such-topic")
    assert_one_clear_line(r, "unknown topic(s) no-such-topic")


def test_unknown_environment_setting(sqlite_dsn: str) -> None:
    r = kstore("migrate", "--dsn", sqlite_dsn, env={"KSTORE_MAX_BATCH": "5"})
    assert_one_clear_line(r, "unknown setting in environment: KSTORE_MAX_BATCH")


def test_debug_shows_the_traceback() -> None:
    r = kstore("--debug", "migrate", "--dsn", "not a url")
    assert r.returncode == 2
    assert "Traceback" in r.stderr


def test_migrate_says_what_it_did(tmp_path: Path) -> None:
    """From which revision to which, or that there was nothing to do: never the same line for both."""
    dsn = f"sqlite:///{tmp_path / 'm.db'}"
    said = []
    for revision in ("0005", "head", "head"):
        r = kstore("migrate", "--dsn", dsn, "--revision", revision)
        assert r.returncode == 0, r.stderr
        said.append(r.stdout.strip())
    assert said == ["kstore tables created: migrated from none to 0005 (head is 0015)",
                    "kstore tables migrated from 0005 to head 0015",
                    "kstore tables already at head 0015: nothing to do"]


def test_version_has_one_source() -> None:
    """``kstore --version`` shows ``kstore.__version__``, the one place the version is written: the
    build reads it (pyproject.toml has no copy) and a released version has its CHANGELOG.md heading."""
    assert kstore("--version").stdout == f"kstore {__version__}\n"
    pyproject = (REPO_DIR / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "kstore.__version__"}' in pyproject
    assert "\nversion = \"" not in pyproject  # no static copy
    assert importlib.metadata.version("kstore") == __version__  # the installed metadata agrees
    if re.fullmatch(r"\d+\.\d+\.\d+", __version__):  # a final release, not a .dev or rc
        heading = rf"\n## \[{re.escape(__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}\n"
        assert re.search(heading, (REPO_DIR / "CHANGELOG.md").read_text())
