"""A griffe extension for the API reference (loaded by mkdocstrings, see mkdocs.yml).

kstore's code is written for Sphinx conventions, which mkdocstrings does not read:

- an attribute is documented by ``#:`` comment lines just above it; they become its docstring;
- ``:class:`Processor``` and friends become links to the object when the reference renders
  it (an "optional" autoref: anything not rendered, e.g. a private helper, stays plain code,
  so these never fail the strict build; a reference written in a page's Markdown still does).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

#: reST's literal-block marker: a line of its own ("::", dropped) or ending a paragraph (shown as ":");
#: the indented block after it is a code block in Markdown too.
MARKER_LINE = re.compile(r"(?m)^[ \t]*::[ \t]*$")
MARKER_END = re.compile(r"(?m)(?<=\S)::$")
ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):`(~?)([\w.]+)(\(\))?`")


def comment_above(obj: griffe.Object) -> str | None:
    """The ``#:`` lines right above ``obj``'s first line, without their markers."""
    if obj.lineno is None or obj.filepath is None or isinstance(obj.filepath, list):
        return None
    try:
        lines = obj.lines_collection[obj.filepath]
    except KeyError:
        return None
    found: list[str] = []
    index = obj.lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return "\n".join(found) or None


def full_path(obj: griffe.Object, target: str) -> str | None:
    """``target`` as written in ``obj``'s docstring, resolved in ``obj``'s scope."""
    if target.startswith("kstore."):
        return target
    head, _, rest = target.partition(".")
    scopes = [obj] if obj.is_class or obj.is_module else []
    scopes += [obj.parent] if obj.parent is not None else []
    for scope in scopes:
        try:
            resolved = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            continue
        return f"{resolved}.{rest}" if rest else resolved
    return None


def link_roles(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        short, target, call = match.group(1), match.group(2), match.group(3) or ""
        title = html.escape((target.rsplit(".", 1)[-1] if short else target) + call)
        path = full_path(obj, target)
        if path is None:
            return f"`{title}`"
        return f'<autoref identifier="{html.escape(path)}" optional><code>{title}</code></autoref>'

    return ROLE.sub(replace, text)


class KstoreDocs(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.is_alias:
            return
        if obj.is_attribute and obj.docstring is None:
            comment = comment_above(obj)
            if comment is not None:
                obj.docstring = griffe.Docstring(comment, parent=obj)
        if obj.docstring is not None:
            text = MARKER_END.sub(":", MARKER_LINE.sub("", obj.docstring.value))
            obj.docstring.value = link_roles(obj, text)
