"""kstore's tests, laid out like the code they check.

- ``unit/``: pure logic, no broker and no PostgreSQL, by kstore package (``unit/engine/`` for
  ``kstore/engine/``, ``unit/test_settings.py`` for ``kstore/settings.py``).
- ``integration/<feature>/``: against the real Kafka broker and PostgreSQL the fixtures start.
- ``sim/``: the deterministic simulation of the engine and its test.
- ``support/``: the harness, the fault proxy and the processors the tests' workers run.
- ``conftest.py``: the fixtures every test can use.
"""
