"""The documentation reads in the repository as on the site: every relative link of every
markdown file of the repository (the README, CONTRIBUTING, the CHANGELOG, docs/, examples/, ...)
points to a file that exists (the reference pages generated from the code are committed, and
current), and every ``#anchor`` to a heading of its page."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from tests.support.harness import REPO_DIR

#: Folders whose markdown is not the repository's own: tools' caches, the virtualenv, build output.
NOT_OURS = frozenset({"site", "dist", "build", "node_modules", "results"})


def markdown_files(root: Path) -> list[Path]:
    """Every markdown file under ``root`` but those in hidden folders (.git, .venv, ...) or
    :data:`NOT_OURS`."""
    return sorted(
        page for page in root.rglob("*.md")
        if not any(part.startswith(".") or part in NOT_OURS or part.endswith(".egg-info")
                   for part in page.relative_to(root).parent.parts))


#: The pages a reader of the repository opens: all of its markdown.
PAGES = markdown_files(REPO_DIR)
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
#: ``[text](target "title")`` and images; the text may hold code spans (removed first).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: ``[label]: target`` definitions of reference-style links.
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXPLICIT_ID = re.compile(r"\{[^}]*#([\w-]+)[^}]*\}\s*$")
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """The page without its code: a link shown in a code block or span is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower-cased, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def heading_text(raw: str) -> str:
    """A heading's text as rendered: links as their text, no emphasis, no code markers."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", EXPLICIT_ID.sub("", raw))
    return re.sub(r"[`*]|(?<!\w)_|_(?!\w)", "", text).strip()


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor the page has, as the site (Python-Markdown's toc) and GitHub make them."""
    found: set[str] = set()
    seen: dict[tuple[str, str], int] = {}  # (family, slug): how many headings had it before
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    for raw in HEADING.findall(text):
        explicit = EXPLICIT_ID.search(raw)
        if explicit:
            found.add(explicit.group(1))
            continue
        heading = heading_text(raw)
        for slug, suffix in ((slugify(heading, "-"), "_"), (github_slug(heading), "-")):
            n = seen.get((suffix, slug), 0)
            seen[(suffix, slug)] = n + 1
            found.add(slug if n == 0 else f"{slug}{suffix}{n}")
    found.update(HTML_ID.findall(text))
    return frozenset(found)


def broken_links(page: Path, root: Path = REPO_DIR) -> list[str]:
    """What is wrong with each relative link of ``page`` (none: an empty list)."""
    problems = []
    text = prose(page.read_text(encoding="utf-8"))
    for target in [*LINK.findall(text), *LINK_DEFINITION.findall(text)]:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto:: not a file of the repository
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        shown = f"{page.relative_to(root)}: ({target})"
        if not linked.is_relative_to(root):
            problems.append(f"{shown}: outside the repository")
        elif not linked.exists():
            problems.append(f"{shown}: no such file {linked.relative_to(root)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{shown}: {linked.relative_to(root)} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO_DIR)) for p in PAGES])
def test_every_relative_link_resolves_in_the_repository(page: Path) -> None:
    assert broken_links(page) == []


def test_the_pages_generated_from_the_code_are_committed_and_current() -> None:
    """docs/configuration.md and docs/cli.md, which the other pages link to, are files of the
    repository, and what scripts/docs-pages would write now (the docs build checks it too)."""
    for name in ("configuration.md", "cli.md"):
        assert (REPO_DIR / "docs" / name).is_file(), f"docs/{name} is missing: run scripts/docs-pages"
    r = subprocess.run([str(REPO_DIR / "scripts" / "docs-pages"), "--check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_checker_finds_what_it_is_for(tmp_path: Path) -> None:
    """A missing file, a missing anchor and a file outside the repository are found; links in code,
    to the web, to headings as the site and as GitHub spell them, and to explicit ids are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Its part\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Title\n\n## A `code`, and: punctuation\n\n## Sub — part {#custom}\n\n## Title\n\n"
        "[ok](#a-code-and-punctuation) [ok](#custom) [ok](#title_1) [ok](#title-1) [ok](https://x.org/y.md)\n"
        "[ok](other.md#its-part) ![ok](other.md) [bad](nowhere.md) [bad](#missing) [bad](other.md#missing)\n"
        "[bad](../../outside.md) `[code](nowhere.md)`\n\n```\n[code](nowhere.md)\n```\n\n"
        "[ref]: other.md#its-part\n[gone]: gone.md\n", encoding="utf-8")
    found = broken_links(page, tmp_path)
    assert [line.split(": (")[1].split(")")[0] for line in found] == \
        ["nowhere.md", "#missing", "other.md#missing", "../../outside.md", "gone.md"], found


def test_every_markdown_file_of_the_repository_is_checked() -> None:
    """The pages a user and a contributor open first are among those checked, and nothing of the
    virtualenv or the built site is."""
    checked = {str(page.relative_to(REPO_DIR)) for page in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/index.md", "examples/README.md"} <= checked
    assert not [name for name in checked if name.startswith((".venv", "site/"))]


def test_markdown_files_skip_hidden_and_built_folders(tmp_path: Path) -> None:
    for name in ("README.md", "docs/a.md", ".venv/lib/x.md", "site/b.md", "pkg.egg-info/c.md", "sub/.hidden/d.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("# x\n", encoding="utf-8")
    assert [str(p.relative_to(tmp_path)) for p in markdown_files(tmp_path)] == ["README.md", "docs/a.md"]
