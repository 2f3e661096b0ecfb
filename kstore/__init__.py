"""kstore: exactly-once Kafka pipelines that write to a SQL database.

Offsets live in the database, in the same transaction as the processing's
own writes; a claimed epoch per partition fences zombie workers.

What users touch sits at the top: this package's names (``__all__``), :mod:`kstore.processor`,
:mod:`kstore.settings`, :mod:`kstore.errors`, :mod:`kstore.targets`, :mod:`kstore.retry`,
:mod:`kstore.testing` and the ``kstore`` command (:mod:`kstore.cli`). The rest is grouped by role,
each subpackage's docstring saying what it owns, what it may import and the invariants it keeps:

- :mod:`kstore.engine`: a running worker, the partitions it holds, its batches;
- :mod:`kstore.db`: kstore's tables and every statement on them, the batch's session;
- :mod:`kstore.kafka`: the consumer and its queues, every Kafka client (the only kafka-python user);
- :mod:`kstore.telemetry`: what a running worker reports (metrics, health probes, traces);
- :mod:`kstore.ops`: the operator's tools (offsets, dead-letter replays, lag, exporter, top).

Imports run one way, down that list (the engine and the operator's tools never import each
other, nor the database and the Kafka sides): pyproject.toml's import contracts hold it.
"""

#: kstore's version: the one place it is written (pyproject.toml reads it; ``kstore --version`` shows it).
__version__ = "0.1.0"

from kstore.concurrency import AsyncSession
from kstore.db.dbapi import BatchTransactionError
from kstore.db.deadletters import DeadLetterBusyError, DeadLetterStateError
from kstore.db.migration import migrate
from kstore.db.session import BatchRollbackError, DeferredInsertError
from kstore.engine.worker import Worker
from kstore.errors import (
    BrokerError,
    CommitInDoubtError,
    ConfigurationError,
    DatabaseError,
    FencedError,
    InvalidOffsetError,
    KstoreError,
    MissingTopicError,
    NotMigratedError,
    ProcessorContractError,
    ProcessorError,
    TooManyDeadLettersError,
    UndeclaredTopicError,
)
from kstore.processor import DeserializationError, Message, Processor, ProduceError, load_processor
from kstore.retry import Reject, Retry, RetryPolicy
from kstore.settings import Settings
from kstore.targets import EARLIEST, LATEST

__all__ = [
    # writing a pipeline
    "AsyncSession",
    "Message",
    "Processor",
    "Reject",
    "Retry",
    "RetryPolicy",
    # running it
    "Settings",
    "Worker",
    "load_processor",
    "migrate",
    # moving offsets
    "EARLIEST",
    "LATEST",
    # errors
    "BatchRollbackError",
    "BatchTransactionError",
    "BrokerError",
    "CommitInDoubtError",
    "ConfigurationError",
    "DeadLetterBusyError",
    "DeadLetterStateError",
    "DeferredInsertError",
    "DeserializationError",
    "DatabaseError",
    "FencedError",
    "InvalidOffsetError",
    "KstoreError",
    "MissingTopicError",
    "NotMigratedError",
    "ProcessorContractError",
    "ProcessorError",
    "ProduceError",
    "TooManyDeadLettersError",
    "UndeclaredTopicError",
]
