"""kstore's Kafka side on kafka-python (``pip install 'kstore[kafka-python]'``): the worker's consumer
(:mod:`.consumer`), the relay's shard publisher (:mod:`.producer`), the operator's questions to the
brokers (:mod:`.admin`; a group's members as described, :mod:`.members`) and how each client is made
from the settings (:mod:`.connect`).

Imported only through :mod:`kstore.kafka.clients`, when the settings choose kafka-python (or the
tools find only it installed). Named ``kafkapython``: inside it, ``from kafka import ...`` is
kafka-python (imports are absolute).
"""

import warnings

with warnings.catch_warnings():
    # kafka-python 3.0 reads each of its protocol schemas, when it is imported, with
    # importlib.resources' read_text (which calls open_text): both deprecated in Python 3.11
    # and 3.12 (no longer in 3.13), two warnings a schema, about 220 in every user's test run.
    # No call of kstore's can avoid them: only these two, and only during this import, are
    # silenced. kstore imports kafka-python here first (``import kstore`` imports this package).
    warnings.filterwarnings("ignore", r"(read_text|open_text) is deprecated\. Use files\(\) instead",
                            DeprecationWarning)
    import kafka  # noqa: F401
