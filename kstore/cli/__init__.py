"""The ``kstore`` command: every subcommand, each a thin layer over one library function.

- :mod:`~kstore.cli.command`: the ``kstore`` group (logging, ``--debug``) and :func:`main`, the
  console script's entry point (and ``python -m kstore``'s);
- :mod:`~kstore.cli.worker`: ``kstore worker`` and ``kstore relay`` (the engine);
- :mod:`~kstore.cli.migrate`: ``kstore migrate`` (the database side);
- :mod:`~kstore.cli.ops` and :mod:`~kstore.cli.letters`: the operator's commands (``offsets``,
  ``outbox``, ``exporter``, ``top``, ``topics``; ``dead-letters``);
- :mod:`~kstore.cli.common`: what every command shares (options, one-line errors, signals).

May import everything below it (the engine, the operator's tools, the database side, settings);
nothing in kstore imports it but ``python -m kstore``. No SQL and no Kafka here: a command parses
its arguments, builds :class:`~kstore.Settings` and calls one library function. A
:class:`~kstore.KstoreError` is one line on stderr and a non-zero exit (2 for configuration);
``--debug`` shows the traceback.
"""

from kstore.cli.command import cli, main

__all__ = ["cli", "main"]
