"""A deterministic simulation of kstore's engine: several workers on one thread.

The real :class:`kstore.Worker` runs, driven one turn at a time (``fetch_once`` and
``step``) in an order a seeded random schedule picks, against

- :mod:`.kafka`: an in-memory cluster and consumer group that behave like
  kafka-python 3's ``KafkaConsumer`` where kstore relies on it (positions advance
  on ``poll()``, eager rebalances, zombies, ``on_partitions_lost``, raising
  ``seek``/``pause``/``resume`` for partitions no longer assigned);
- :mod:`.db`: one SQLite file per schedule, with faults at the DBAPI level
  (a COMMIT whose answer is lost, its connection cut as on a real network, the COMMIT
  landed, in flight or never sent; a COMMIT that fails; statements failing while the
  database is down), counted as they fire, and a journal, written by triggers, of
  every row kstore and the processor commit;
- :mod:`.clock`: a scripted clock in place of ``time`` in kstore's modules.

:mod:`.invariants` checks the journal and the deliveries after every action;
:mod:`.schedule` generates, runs and shrinks schedules. ``tests/sim/test_simulation.py``
runs them under pytest.

Invisible to it: everything kstore does only on PostgreSQL (the one-trip commit of
psycopg2, execute_batch pages, COPY, lock and idle-in-transaction timeouts, SQLSTATE
classification, the database deadline's watchdog). It runs kstore on SQLite; the
tests against a real PostgreSQL cover those paths.
"""
