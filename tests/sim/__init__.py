"""A deterministic simulation of kstore's engine: several workers on one thread.

The real :class:`kstore.Worker` runs, driven one turn at a time (``fetch_once`` and
``step``) in an order a seeded random schedule picks, against

- :mod:`.kafka`: an in-memory cluster and consumer group that behave like
  kafka-python 3's ``KafkaConsumer`` where kstore relies on it (positions advance
  on ``poll()``, eager rebalances, zombies, ``on_partitions_lost``, raising
  ``seek``/``pause``/``resume`` for partitions no longer assigned);
- :mod:`.db`: one SQLite file per schedule, with faults at the DBAPI level
  (a COMMIT whose answer is lost, a COMMIT that fails, statements failing while
  the database is down) and a journal, written by triggers, of every row kstore
  and the processor commit;
- :mod:`.clock`: a scripted clock in place of ``time`` in kstore's modules.

:mod:`.invariants` checks the journal and the deliveries after every action;
:mod:`.schedule` generates, runs and shrinks schedules. ``tests/test_simulation.py``
runs them under pytest.
"""
