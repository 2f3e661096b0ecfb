"""What the tests run on: the harness, the fault proxy, lossy engines and the test processors.

``kstore worker`` subprocesses start in this folder with it on ``PYTHONPATH``, so a test names a
processor as ``processors:Recorder`` or ``outbox_processors:Booker``.
"""
