"""kstore: exactly-once Kafka pipelines that write to a SQL database.

Offsets live in the database, in the same transaction as the processing's
own writes; a claimed epoch per partition fences zombie workers.
"""

from .dbapi import BatchTransactionError
from .deadletters import DeadLetterStateError
from .errors import (
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
from .migration import migrate
from .processor import Message, Processor
from .retry import Reject, Retry, RetryPolicy
from .session import BatchRollbackError, DeferredInsertError
from .settings import Settings
from .targets import EARLIEST, LATEST
from .worker import Worker, load_processor

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
