"""kstore: exactly-once Kafka pipelines that write to a SQL database.

Offsets live in the database, in the same transaction as the processing's
own writes; a claimed epoch per partition fences zombie workers.
"""

from kstore.db.dbapi import BatchTransactionError
from kstore.db.deadletters import DeadLetterStateError
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
    NotMigratedError,
    ProcessorContractError,
    ProcessorError,
)
from kstore.processor import Message, Processor, load_processor
from kstore.retry import Reject, Retry, RetryPolicy
from kstore.settings import Settings
from kstore.targets import EARLIEST, LATEST

__all__ = [
    # writing a pipeline
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
    "DeadLetterStateError",
    "DeferredInsertError",
    "DatabaseError",
    "FencedError",
    "InvalidOffsetError",
    "KstoreError",
    "NotMigratedError",
    "ProcessorContractError",
    "ProcessorError",
]
