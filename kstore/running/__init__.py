"""Running a processor: how kstore calls the code a user wrote, shared by the engine (a worker's
batches), the operator's tools (a dead letter's replay) and :mod:`kstore.testing` (``run_batch``).

- :mod:`~kstore.running.handler`: one batch in the caller's open transaction (:func:`run_handler`),
  what ``produce()`` collects and checks;
- :mod:`~kstore.running.hooks`: the checks of a processor and of what its hooks return, ``setup()``
  under the group's lock, a record deserialized into a :class:`~kstore.Message`;
- :mod:`~kstore.running.concurrency`: the async lanes (an ``async def handle``'s messages run
  concurrently, one key after another) and :class:`~kstore.AsyncSession`;
- :mod:`~kstore.running.loading`: a processor found by ``MODULE:CLASS`` (:func:`~kstore.load_processor`).

May import the database side (the batch's session, the setup lock), :mod:`kstore.processor` and
the shared vocabulary; never the engine, the operator's tools, the Kafka side, the telemetry (a
tracer is a protocol here, :class:`~kstore.running.handler.Spans`) or the CLI.

Invariant: nothing here commits. The caller owns the transaction; a batch whose handlers did not
all finish raises, and is rolled back.
"""
