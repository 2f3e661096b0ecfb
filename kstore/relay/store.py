"""One group's outbox in one database: every statement on its tables, in one object.

:class:`Outbox` is the parts put together, each in a module of its own idea: the shards and their
incarnation (:mod:`kstore.relay.shards`), the write inside a batch's transaction
(:mod:`kstore.relay.writing`), the leases of the lanes (:mod:`kstore.relay.leases`), and what waits
and how far it was published (:mod:`kstore.relay.backlog`). The tables are in
:mod:`kstore.relay.tables`; the invariants in :mod:`kstore.relay`'s docstring.
"""

from __future__ import annotations

from .backlog import OutboxBacklog
from .leases import OutboxLeases
from .writing import OutboxWrites


class Outbox(OutboxWrites, OutboxLeases, OutboxBacklog):
    """The outbox of one group (or an application's, by its name) in one database."""
