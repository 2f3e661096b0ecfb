"""A deterministic simulation of kstore's engine: several workers on one thread.

The real :class:`kstore.Worker` runs, driven one turn at a time (``fetch_once`` and
``step``) in an order a seeded random schedule picks, against

- :class:`kstore.kafka.stub.StubCluster`: kstore's in-memory Kafka, its worker consumer speaking
  the seam as the real clients do (positions advance in a fetch, eager rebalances, zombies
  that hear of their expulsion late, ``lost`` events, seek/pause/resume skipping partitions no
  longer assigned), with the world's random source for the group's and the fetches' choices and
  the preemption points of :mod:`.threads` inside each fetch; about half the schedules give the
  workers confluent-kafka's threading (callbacks only inside a fetch, applied there at once; seeks
  and pauses carried out by the next fetch), the others kafka-python's (``world.CLIENTS``);
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
