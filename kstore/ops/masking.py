"""Secrets kept out of what kstore prints, logs and shows (the ``kstore`` command, the web console):
by where they stand, never by their text.

kstore's own lines never hold a secret in the first place: a DSN is shown as SQLAlchemy renders
it with the password hidden (``Settings.safe_dsn``), and Kafka passwords are never formatted
into text (``Settings``' repr leaves them out; a Kafka option that holds one is shown as
``***`` by :func:`kstore.kafka.options.shown_options`).

What a driver or a client library says is not kstore's to word, so :class:`Masker` hides what
stands in a credential position of such text (the password of a URL, the value of a
``password=...`` pair) and nothing else. Replacing a secret wherever its text occurs would garble
ordinary words (a password ``p`` in "imported") and, where a password equals the user name,
point at the password.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, quote_plus

from kstore.kafka.options import MASK

#: A URL up to its password: ``scheme://user:``.
_URL_PASSWORD = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@?#'\"]*:")
#: A pair whose name says it holds a secret, up to its value: ``password=``, ``'sasl.password': ``.
_SECRET_PAIR = re.compile(r"(?i)\b[\w.\-]*(?:password|passwd|pwd|secret|passphrase)['\"]?\s*[:=]\s*")
#: Where an unquoted value ends when no known secret stands there.
_VALUE_END = re.compile(r"[\s,;&)}\]'\"]")
class Masker:
    """Hides the credentials in a third party's text: a URL's password and the value of a
    password-like ``name=value`` (or ``'name': 'value'``) pair, whatever they are.

    ``secrets`` (the values the settings hold) only tell where such a value ends when it has
    characters that would otherwise end it (a space, a comma, an ``@``): a secret standing
    anywhere else is left alone, since it cannot be told from an ordinary word there.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        forms = {form for secret in secrets if secret for form in (secret, quote(secret, safe=""), quote_plus(secret))}
        #: Longest first: a secret that begins with another is matched whole.
        self._forms = sorted(forms, key=len, reverse=True)

    def mask(self, text: str) -> str:
        text = self._replace(text, _URL_PASSWORD, self._url_password_end)
        return self._replace(text, _SECRET_PAIR, self._pair_value_end)

    @staticmethod
    def _replace(text: str, head: re.Pattern[str], value_end: Any) -> str:
        out, pos = [], 0
        for found in head.finditer(text):
            start = found.end()
            if start < pos:  # inside a value masked already
                continue
            end = value_end(text, start)
            if end is None or end == start:
                continue
            out.append(text[pos:start])
            out.append(MASK)
            pos = end
        out.append(text[pos:])
        return "".join(out)

    def _url_password_end(self, text: str, start: int) -> int | None:
        """Where the password that starts at ``start`` ends (at its ``@``), or None if this is no URL with one."""
        for form in self._forms:
            if text.startswith(form + "@", start):
                return start + len(form)
        token_end = _token_end(text, start, r"[\s'\"]")
        at = text.rfind("@", start, token_end)
        return at if at >= 0 else None

    def _pair_value_end(self, text: str, start: int) -> int | None:
        quote_char = text[start:start + 1]
        if quote_char in ("'", '"'):
            for form in self._forms:
                if text.startswith(form + quote_char, start + 1):
                    return start + 1 + len(form) + 1
            close = text.find(quote_char, start + 1)
            return len(text) if close < 0 else close + 1
        for form in self._forms:
            after = start + len(form)
            if text.startswith(form, start) and (after == len(text) or _VALUE_END.match(text, after)):
                return after
        return _token_end(text, start, _VALUE_END.pattern)


def _token_end(text: str, start: int, end_class: str) -> int:
    found = re.compile(end_class).search(text, start)
    return len(text) if found is None else found.start()
