"""MkDocs hooks (see mkdocs.yml).

The build fails while ``configuration.md`` or ``cli.md`` differ from what the code generates
(docs/pages.py): they are committed files, rewritten by ``scripts/docs-pages``.

And links from a page to a file of the repository outside docs/ (``../kstore/db/session.py``),
which the site does not hold, are shown as the file's path; a link to a file that does not
exist is left alone, so that the strict build fails on it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pages  # docs/pages.py: mkdocs puts a hook's folder on sys.path while it loads the hook
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_pre_build(config: MkDocsConfig) -> None:
    outdated = pages.stale()
    if outdated:
        names = " and ".join(f"docs/{name}" for name in outdated)
        raise PluginError(f"out of date with the code: {names}; run scripts/docs-pages and commit the result")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    docs_dir = Path(config.docs_dir).resolve()
    page_dir = (docs_dir / page.file.src_path).parent

    def outside(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs_dir) or not path.is_relative_to(ROOT) or not path.exists():
            return match.group(0)
        shown = f"`{path.relative_to(ROOT).as_posix()}`"
        return shown if text.strip("`") == path.relative_to(ROOT).as_posix() else f"{text} ({shown})"

    return LINK.sub(outside, markdown)
