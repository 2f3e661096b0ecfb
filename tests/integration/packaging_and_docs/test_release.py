"""The way in and the way out. In: the install commands of the README's and Getting started's
"Installing" sections work as written; kstore is not on PyPI until ``scripts/release`` uploads it
there and records it in CHANGELOG.md (a link from the version's heading to its PyPI page), so until
then they install from a checkout or a wheel built from one. Out: ``scripts/release`` refuses to
upload without credentials, from a working tree that differs from its commit, a version the
changelog has not released, or one the index already has.

Nothing is uploaded: the release runs in a copy of the checkout whose ``scripts/release-check`` is a
stub that stops it (exit 97) before anything could be built or sent, and the index it asks is a
local server.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

import kstore
from tests.support.harness import REPO_DIR

INSTALL_PAGES = [REPO_DIR / "README.md", REPO_DIR / "docs" / "getting-started.md"]
#: The copy's release-check: reaching it means every refusal let the release through.
STUB = "#!/bin/sh\necho 'release-check reached' >&2\nexit 97\n"
TOKEN = "pypi-s3cret-token-never-shown"


def installing_section(page: Path) -> str:
    text = page.read_text()
    start = text.index("\n## Installing\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def commands(section: str) -> list[str]:
    """The pip commands a reader copies: the lines of the shell blocks (comments cut) and the inline
    code that starts with ``pip`` (an error message quoted inline is not one)."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL):
        found += [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]
    found += re.findall(r"(?<!`)`(pip [^`]+)`", re.sub(r"```.*?```", "", section, flags=re.DOTALL))
    return [c for c in found if c.startswith("pip ")]


def requirements(command: str) -> list[str]:
    """What a ``pip install`` or ``pip wheel`` command installs or builds: its arguments that are not options."""
    words = shlex.split(command)[2:]
    taken, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("-w", "--wheel-dir", "-r", "-c"):
            skip = True
        elif not word.startswith("-"):
            taken.append(word)
    return taken


def is_path(requirement: str) -> bool:
    return requirement.startswith((".", "/")) or "/" in requirement or ".whl" in requirement


def published() -> set[str]:
    """The versions CHANGELOG.md links to their page on PyPI, as scripts/release records an upload."""
    return set(re.findall(r"^\[(\d[^\]]*)\]: https://pypi\.org/project/kstore/\1/?$",
                          (REPO_DIR / "CHANGELOG.md").read_text(), re.MULTILINE))


def optional_dependencies() -> str:
    """pyproject.toml's [project.optional-dependencies] table, as text."""
    text = (REPO_DIR / "pyproject.toml").read_text()
    start = text.index("[project.optional-dependencies]\n")
    return text[start:text.index("\n[", start + 1)]


def copy_checkout(to: Path) -> Path:
    """The checkout's files as they are now (tracked and new, not ignored ones), without its history."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_DIR,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_DIR / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


@pytest.mark.parametrize("page", INSTALL_PAGES, ids=lambda p: p.name)
def test_the_install_commands_name_kstore_on_pypi_only_once_a_release_is_published_there(page: Path) -> None:
    section = installing_section(page)
    found = commands(section)
    assert any(c.startswith("pip install") for c in found), section
    extras = set(re.findall(r"^([\w-]+) = \[", optional_dependencies(), re.MULTILINE))
    on_pypi = published()
    for command in found:
        for requirement in requirements(command):
            if is_path(requirement):
                wheels = re.findall(r"kstore-([^-]+)-py3-none-any\.whl", requirement)
                assert all(v == kstore.__version__ for v in wheels), (command, kstore.__version__)
                named = re.findall(r"\[([^\]]*)\]", requirement)
                assert all(set(e.split(",")) <= extras for e in named), (command, extras)
                continue
            req = Requirement(requirement)
            if req.name != "kstore":
                continue  # another package, from the index (psycopg2-binary)
            pinned = {s.version for s in req.specifier} or {kstore.__version__}
            assert pinned <= on_pypi, (f"{page.name}: {command!r} installs kstore from the index, which has no "
                                       f"kstore {', '.join(sorted(pinned))} (CHANGELOG.md links none to PyPI)")
            assert req.extras <= extras, command
    for version in re.findall(r"kstore==([\w.]+)", section):
        assert version == kstore.__version__, (page.name, version)


def test_the_install_commands_install_this_checkouts_version(tmp_path: Path) -> None:
    """Each command run as written, from a folder holding a copy of the checkout as ``./kstore``: the
    wheel it builds is this version's, and each install (a dry run) is kstore at this version with the
    extras it names. kstore from the index is left to the test above."""
    copy_checkout(tmp_path / "kstore")
    ran = []
    for command in dict.fromkeys(c for page in INSTALL_PAGES for c in commands(installing_section(page))):
        ours = [r for r in requirements(command) if is_path(r)]
        if not ours:
            continue
        if command.startswith("pip wheel"):
            r = subprocess.run([sys.executable, "-m", "pip", *shlex.split(command)[1:]],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
            assert (tmp_path / "dist" / f"kstore-{kstore.__version__}-py3-none-any.whl").is_file(), command
            ran.append(command)
            continue
        report = tmp_path / "report.json"
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet",
                            "--disable-pip-version-check", "--report", str(report), *ours],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
        (installed,) = json.loads(report.read_text())["install"]
        assert (installed["metadata"]["name"], installed["metadata"]["version"]) == ("kstore", kstore.__version__)
        asked = {e for r in ours for e in re.findall(r"\[([^\]]*)\]", r) for e in e.split(",")}
        assert set(installed.get("requested_extras") or ()) == asked, (command, installed.get("requested_extras"))
        ran.append(command)
    assert any("pip wheel" in c for c in ran) and any(".whl" in c for c in ran), ran


# -- scripts/release -------------------------------------------------------------------------------


@pytest.fixture
def release_copy(tmp_path: Path) -> Path:
    """A copy of the checkout, committed in a repository of its own, whose release-check is the stub."""
    repo = copy_checkout(tmp_path / "repo")
    (repo / "scripts" / "release-check").write_text(STUB)
    (repo / ".venv").symlink_to(REPO_DIR / ".venv")
    git(repo, "init", "-q")
    (repo / ".git" / "info" / "exclude").write_text(".venv\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "copy")
    return repo


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo, check=True,
                   capture_output=True)


def release(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TWINE_", "KSTORE_RELEASE_"))}
    return subprocess.run([str(repo / "scripts" / "release"), *args], cwd=repo, capture_output=True, text=True,
                          timeout=120, env={**clean, **env})


def assert_refused(r: subprocess.CompletedProcess[str], why: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("release: refused: ") and why in lines[0], r.stderr
    assert "release-check reached" not in r.stderr and TOKEN not in r.stdout + r.stderr


def ready_changelog(repo: Path, version: str = kstore.__version__, unreleased: str = "") -> None:
    (repo / "CHANGELOG.md").write_text(f"# Changelog\n\n## [Unreleased]\n{unreleased}\n## [{version}] - 2026-01-01\n\n"
                                       "- the release\n")
    git(repo, "commit", "-q", "-am", "changelog")


def test_the_release_refuses_without_credentials(release_copy: Path) -> None:
    assert_refused(release(release_copy), "no credentials: set TWINE_PASSWORD")
    assert_refused(release(release_copy, "--test-pypi", TWINE_USERNAME="__token__"), "no credentials")
    assert not (release_copy / "dist").exists()


def test_the_release_refuses_a_working_tree_that_differs_from_its_commit(release_copy: Path) -> None:
    readme = release_copy / "README.md"
    readme.write_text(readme.read_text() + "\nan edit\n")
    assert_refused(release(release_copy, TWINE_PASSWORD=TOKEN), "the working tree differs from its last commit")
    git(release_copy, "checkout", "README.md")
    (release_copy / "kstore" / "extra_module.py").write_text("")  # would be built into the wheel
    r = release(release_copy, TWINE_PASSWORD=TOKEN)
    assert_refused(r, "the working tree differs from its last commit")
    assert "kstore/extra_module.py" in r.stderr


def test_the_release_refuses_a_version_the_changelog_has_not_released(release_copy: Path) -> None:
    ready_changelog(release_copy, unreleased="\n- not released yet\n")
    assert_refused(release(release_copy, TWINE_PASSWORD=TOKEN), "CHANGELOG.md has entries under Unreleased")
    ready_changelog(release_copy, version="9.9.9")
    assert_refused(release(release_copy, TWINE_PASSWORD=TOKEN),
                   f"kstore/__init__.py says {kstore.__version__} but CHANGELOG.md's newest release is '9.9.9'")


@pytest.fixture
def index() -> Iterator[dict[str, Any]]:
    """A local stand-in for an index's simple API: ``answer["status"]`` and ``answer["files"]`` say
    what ``/simple/kstore/`` answers; ``answer["url"]`` is its base."""
    answer: dict[str, Any] = {"status": 404, "files": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = int(answer["status"]) if self.path == "/simple/kstore/" else 404
            body = "".join(f'<a href="/files/{f}">{f}</a>\n' for f in answer["files"]).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answer["url"] = f"http://127.0.0.1:{server.server_address[1]}/simple"
    yield answer
    server.shutdown()


def test_the_release_refuses_a_version_the_index_already_has(release_copy: Path, index: dict[str, Any]) -> None:
    ready_changelog(release_copy)
    url = str(index["url"])
    index.update(status=200, files=[f"kstore-{kstore.__version__}.tar.gz",
                                    f"kstore-{kstore.__version__}-py3-none-any.whl"])
    assert_refused(release(release_copy, TWINE_PASSWORD=TOKEN, KSTORE_RELEASE_SIMPLE_URL=url),
                   f"{url} already has kstore {kstore.__version__}")
    index.update(status=500, files=[])
    assert_refused(release(release_copy, TWINE_PASSWORD=TOKEN, KSTORE_RELEASE_SIMPLE_URL=url),
                   f"cannot tell whether {url} has kstore {kstore.__version__}: HTTP 500")
    # Another version there, or none at all: nothing refuses, and the release goes on to its checks.
    for status, files in ((200, ["kstore-0.0.1.tar.gz"]), (404, [])):
        index.update(status=status, files=files)
        r = release(release_copy, TWINE_PASSWORD=TOKEN, KSTORE_RELEASE_SIMPLE_URL=url)
        assert r.returncode == 97 and "release-check reached" in r.stderr, (r.stdout, r.stderr)
        assert TOKEN not in r.stdout + r.stderr
