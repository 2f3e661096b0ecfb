"""The web console: see a pipeline and act on it in a browser (``kstore console``).

- :mod:`~kstore.console.app`: :func:`app`, the ASGI application (served by ``kstore console``, or
  mounted in yours), its login and logout;
  :mod:`~kstore.console.access` and :mod:`~kstore.console.auth`: who the operator is, CSRF, read-only.
- :mod:`~kstore.console.pages`: the overview, dead letters, offsets and outbox pages and their actions.
- :mod:`~kstore.console.state`: what the pages share; :mod:`~kstore.console.sampling`: the lag
  sampler and its charts.

May import the operator's tools (:mod:`kstore.ops`), the database side, :mod:`kstore.processor` and
the shared vocabulary; never the engine (no worker runs here) nor the CLI. Its actions go through
the same library calls as the ``kstore`` commands, with the operator recorded in the histories.

Invariants: no action is taken on a read-only console, without an operator, or without the
session's CSRF token; no page shows a secret of the settings (the DSN is shown masked).
"""

from __future__ import annotations

from .app import app

__all__ = ["app"]
