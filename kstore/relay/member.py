"""The name a worker goes by, shared by the worker and its relay (and, as its Kafka client id, the
consumer): one spelling everywhere, unique per process."""

from __future__ import annotations

import os
import socket
import uuid


def member_name() -> str:
    """The name a worker (or a relay) goes by, unique per process: in its log lines, in the
    database (a claimed partition's owner, an outbox shard's) and, as its Kafka client id, in
    ``kstore offsets show`` and ``kstore top``. One spelling everywhere, to grep for."""
    return f"kstore-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
