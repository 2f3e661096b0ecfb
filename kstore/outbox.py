"""Exactly-once events from application code: a web request (or any transaction) writes to kstore's
outbox in its own transaction, and a relay publishes what committed, once.

::

    from kstore.outbox import Outbox

    events = Outbox("shop-web")       # published by: kstore relay --outbox shop-web

    with Session(engine) as session, session.begin():
        session.add(order)
        events.produce(session, "order-placed", {"id": order.id}, key=str(order.id))

What it promises is what a processor's ``produce()`` does: a ``read_committed`` reader sees each
record of a committed transaction once, nothing of a rolled-back one, and one key's records in the
order their transactions committed.

**Concurrency.** Records are spread over the outbox's shards by key; a transaction holds the row
lock of each shard it writes from its records' write to its COMMIT, which numbers them in commit
order. On a SQLAlchemy ``Session`` (or ``AsyncSession``) the records wait in the session and are
written in its ``before_commit``, after the session's own changes are flushed, in shard order: the
lock is held only for the commit itself, and two transactions never deadlock on it. So up to
``shards`` transactions commit records at once (transactions whose keys fall in different shards
never wait for each other); past eight shards the relay publishes them in eight lanes, so more
shards cost it no more producers (:mod:`kstore.relay.lanes`). What a commit pays under the lock, on
PostgreSQL: for a few records of one shard, one statement (the shard's numbering, the rows and, if
the relay waits, its NOTIFY) and the COMMIT; for more, an ``UPDATE ... RETURNING`` per shard and
one ``INSERT`` (COPY for many) before it. Only the commit that the shard's idle relay waits for
NOTIFYs; while the relay publishes, none does. On a ``Connection`` the records are written at once
(the lock is held from there to COMMIT): give a transaction's records in one :meth:`Outbox.produce_many`.
"""

from kstore.relay.application import Outbox, Record

__all__ = ["Outbox", "Record"]
