"""PostgreSQL SQL text as tokens: what a ``text()`` statement is, judged by its tokens, not its words.

The batch session defers a ``text("INSERT ...")`` and sends many of them together
(:mod:`kstore.db.manyrows`); whether a text qualifies, and where its one ``VALUES`` row is,
must not be fooled by a comment, a string literal holding ``;`` or ``--``, a quoted
identifier or a dollar-quoted body. This lexer knows PostgreSQL's rules for those:

- comments: ``--`` to the end of the line, and ``/* ... */``, which nest;
- string literals: ``'...'`` with ``''`` for a quote (``standard_conforming_strings``, on
  since PostgreSQL 9.1), ``E'...'`` with backslash escapes too; ``B''``, ``X''``, ``N''`` and
  ``U&''`` are a word then a standard literal, which is the same for splitting;
- quoted identifiers (``"..."`` with ``""``), dollar quoting (``$$...$$``, ``$tag$...$tag$``);
- SQLAlchemy's binds: ``:name`` in the text a user writes, ``%(name)s`` once compiled for
  psycopg.

Anything it cannot read to the end (an unterminated literal or comment) is None: such a
text is never rewritten, it runs as written and the server reports it. (sqlparse was
tried: it reads ``/* a /* b */ c */`` as a comment followed by ``c */``.)
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Token(NamedTuple):
    kind: str  # space, comment, string, ident, dollar, param, bind, word, number, op, punct
    text: str
    start: int


_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>--[^\n]*)
  | (?P<block>/\*)
  | (?P<string>[eE]'(?:[^'\\]|\\.|'')*'|'(?:[^']|'')*')
  | (?P<ident>"(?:[^"]|"")*")
  | (?P<dollar>\$(?P<tag>(?:[^\W\d]\w*)?)\$.*?\$(?P=tag)\$)
  | (?P<param>%\(\w+\)s)
  | (?P<bind>(?<![:\w\\]):\w+)
  | (?P<word>[^\W\d]\w*(?:\$\w*)*)
  | (?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)
  | (?P<op>::|%%)
  | (?P<punct>.)
""", re.VERBOSE | re.DOTALL)
_BLOCK = re.compile(r"/\*|\*/")
#: Tokens that say nothing to the server.
QUIET = frozenset({"space", "comment"})


def _block_end(sql: str, at: int) -> int | None:
    """The end of the (nested) ``/* ... */`` comment opened at ``at``, or None if it never closes."""
    depth = 0
    for found in _BLOCK.finditer(sql, at):
        depth += 1 if found.group() == "/*" else -1
        if depth == 0:
            return found.end()
    return None


def tokens(sql: str) -> list[Token] | None:
    """Every token of ``sql`` in order (their texts joined give ``sql`` back), or None if a literal,
    quoted identifier or comment does not end."""
    out: list[Token] = []
    at, n = 0, len(sql)
    while at < n:
        found = _TOKEN.match(sql, at)
        if found is None:  # pragma: no cover - the last alternative takes any character
            return None
        kind = found.lastgroup or "punct"
        end = found.end()
        if kind == "tag":
            kind = "dollar"
        if kind == "block":
            block_end = _block_end(sql, at)
            if block_end is None:
                return None
            kind, end = "comment", block_end
        elif kind == "punct" and sql[at] in "'\"$" and not _lone_dollar(sql, at):
            return None  # a quote that never closes
        out.append(Token(kind, sql[at:end], at))
        at = end
    return out


def _lone_dollar(sql: str, at: int) -> bool:
    """``$`` that opens no dollar quote: ``$1`` (a positional parameter) or a ``$`` inside nothing."""
    return sql[at] == "$" and re.match(r"\$(?:[^\W\d]\w*)?\$", sql[at:]) is None


def significant(toks: list[Token]) -> list[Token]:
    return [t for t in toks if t.kind not in QUIET]


def _is_word(token: Token, word: str) -> bool:
    return token.kind == "word" and token.text.upper() == word


def statement_end(toks: list[Token]) -> int | None:
    """Where the one statement of ``toks`` ends: the index after its last token that is not a comment,
    space or a final ``;``; None if there is no statement or a second one after a ``;``."""
    body = [i for i, t in enumerate(toks) if t.kind not in QUIET]
    if body and toks[body[-1]].text == ";" and toks[body[-1]].kind == "punct":
        body.pop()
    if not body or any(toks[i].kind == "punct" and toks[i].text == ";" for i in body):
        return None
    return body[-1] + 1


_ONE_INSERT: dict[str, bool] = {}


def is_one_insert(sql: str) -> bool:
    """``sql`` is exactly one INSERT statement with no RETURNING: it starts with the word INSERT
    (comments first are fine; ``WITH ... INSERT`` is not, its CTEs may write), and nothing but
    comments, space and one ``;`` follow it. Remembered per SQL string: it is the same few
    strings for every message."""
    verdict = _ONE_INSERT.get(sql)
    if verdict is None:
        if len(_ONE_INSERT) >= 1024:
            _ONE_INSERT.clear()
        verdict = _ONE_INSERT[sql] = _one_insert(sql)
    return verdict


def _one_insert(sql: str) -> bool:
    toks = tokens(sql)
    if toks is None or statement_end(toks) is None:
        return False
    body = significant(toks)
    return _is_word(body[0], "INSERT") and not any(_is_word(t, "RETURNING") for t in body)


def body_of(sql: str) -> str | None:
    """``sql`` (one statement) without what follows its last token: trailing comments, space and ``;``,
    so that it can be followed by anything (``;\\n`` and the next statement) and lose nothing."""
    toks = tokens(sql)
    end = None if toks is None else statement_end(toks)
    if toks is None or end is None:
        return None
    last = toks[end - 1]
    return sql[:last.start + len(last.text)]


#: What a row of a multi-row INSERT may hold besides its parameters: constants and casts, nothing
#: that reads the database (a subquery would see the rows before it when run one by one, none together).
_ROW_WORDS = frozenset({"NULL", "TRUE", "FALSE"})
_ROW_KINDS = frozenset({"space", "comment", "string", "number", "param"})


def ending_values_row(sql: str) -> tuple[str, str] | None:
    """A compiled INSERT split before the one ``VALUES (...)`` row it ends with: (what comes before,
    the row), with what followed the row (comments, a ``;``) dropped; None if it does not end so.

    The row may hold parameters, constants and ``::type`` casts only."""
    toks = tokens(sql)
    end = None if toks is None else statement_end(toks)
    if toks is None or end is None or toks[end - 1].text != ")":
        return None
    depth, i = 0, end - 1
    while i >= 0:
        text = toks[i].text if toks[i].kind == "punct" else ""
        depth += (text == ")") - (text == "(")
        if depth == 0:
            break
        i -= 1
    before = [t for t in toks[:i] if t.kind not in QUIET]
    if i < 0 or not before or not _is_word(before[-1], "VALUES") or not _plain_row(toks[i + 1:end - 1]):
        return None
    if any(t.kind == "param" for t in toks[:i]) or _depth(toks[:i]) != 0:
        return None
    return sql[:toks[i].start], sql[toks[i].start:toks[end - 1].start + 1]


def _plain_row(row: list[Token]) -> bool:
    words = [t for t in row if t.kind not in QUIET]
    i = 0
    while i < len(words):
        t = words[i]
        if t.kind == "op" and t.text == "::":
            # A cast: one type name, of one word or of several (``TIMESTAMP WITH TIME ZONE``,
            # which psycopg 3's dialect renders for a timezone-aware DateTime).
            if i + 1 >= len(words) or words[i + 1].kind != "word":
                return False
            i += 2
            for tail in _TYPE_TAILS.get(words[i - 1].text.upper(), ()):
                if [w.text.upper() for w in words[i:i + len(tail)] if w.kind == "word"] == list(tail):
                    i += len(tail)
                    break
            continue
        if not (t.kind in _ROW_KINDS or (t.text == "," and t.kind == "punct")
                or (t.kind == "word" and t.text.upper() in _ROW_WORDS)):
            return False
        i += 1
    return True


#: The type names of more than one word a cast may name, by their first word: what may follow it.
_TYPE_TAILS: dict[str, tuple[tuple[str, ...], ...]] = {
    "TIMESTAMP": (("WITH", "TIME", "ZONE"), ("WITHOUT", "TIME", "ZONE")),
    "TIME": (("WITH", "TIME", "ZONE"), ("WITHOUT", "TIME", "ZONE")),
    "DOUBLE": (("PRECISION",),),
    "CHARACTER": (("VARYING",),),
    "BIT": (("VARYING",),),
}


def _depth(toks: list[Token]) -> int:
    return sum((t.text == "(") - (t.text == ")") for t in toks if t.kind == "punct")
