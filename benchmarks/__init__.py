"""kstore's side-by-side benchmark: ``python -m benchmarks --help`` (results: docs/benchmarks.md).

The parent process (``cli``, ``runner``) starts the services, fills the topics
and runs every contender in its own child process (``child``), so each one's
peak memory and CPU time are its own. Nothing here is imported by kstore.
"""
