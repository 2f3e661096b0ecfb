"""kstore: exactly-once Kafka pipelines that write to a SQL database.

Offsets live in the database, in the same transaction as the processing's
own writes; a claimed epoch per partition fences zombie workers.

What users touch sits at the top: this package's names (``__all__``), :mod:`kstore.processor`
(the ``Processor`` a user writes and the ``Message`` it receives), :mod:`kstore.settings`,
:mod:`kstore.errors`, :mod:`kstore.targets`, :mod:`kstore.retry`, :mod:`kstore.testing` and
:mod:`kstore.types` (the plain types every part shares). The rest is grouped by role, each
subpackage's docstring saying what it owns, what it may import and the invariants it keeps:

- :mod:`kstore.cli`: the ``kstore`` command, each subcommand a thin layer over one library call;
- :mod:`kstore.engine`: a running worker, the partitions it holds, its batches (and the relay it runs);
- :mod:`kstore.ops`: the operator's tools (offsets, dead-letter replays, outboxes, lag, exporter, top);
- :mod:`kstore.relay`: the outbox and its relay (the records' tables and statements, the relay's
  loop, the progress it leaves in Kafka), run in a worker or on its own (``kstore relay``);
- :mod:`kstore.telemetry`: what a running worker reports (metrics, health probes, traces);
- :mod:`kstore.running`: how kstore calls a processor (a batch, its hooks, the async lanes),
  shared by the engine, the operator's tools and :mod:`kstore.testing`;
- :mod:`kstore.db`: kstore's tables and every statement on them, the batch's session;
- :mod:`kstore.kafka`: the seam to Kafka (its protocols and plain types), the two clients behind
  it as peers (confluent-kafka and kafka-python, the only users of their libraries), an in-memory
  stub peer for tests, and the Kafka option tables :class:`~kstore.Settings` checks its options with.

Imports run one way, down that list (the engine and the operator's tools never import each
other, nor the database and the Kafka sides): pyproject.toml's import contracts hold it.
"""

#: kstore's version: the one place it is written (pyproject.toml reads it; ``kstore --version`` shows it).
__version__ = "0.1.0"

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
    RegistryUnavailableError,
    TooManyDeadLettersError,
    UndeclaredTopicError,
)
from kstore.processor import Processor
from kstore.retry import DeserializationError, ProduceError, Reject, Retry, RetryPolicy
from kstore.running.concurrency import AsyncSession
from kstore.running.loading import load_processor
from kstore.settings import Settings
from kstore.targets import EARLIEST, LATEST
from kstore.types import Message

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
    "RegistryUnavailableError",
    "NotMigratedError",
    "ProcessorContractError",
    "ProcessorError",
    "ProduceError",
    "TooManyDeadLettersError",
    "UndeclaredTopicError",
]
