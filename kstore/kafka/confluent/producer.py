"""The outbox relay's publisher on librdkafka (confluent-kafka): a transport that satisfies
:class:`kstore.relay.publisher.ShardPublisher`, whose docstring says what a lane's transaction holds
(its records and its progress record, given encoded) and how a zombie is fenced. The progress is
read back by the relay through its :class:`~kstore.kafka.seam.GroupReader`
(:class:`kstore.kafka.confluent.admin.ConfluentAdmin` beside it).

Why librdkafka: kafka-python encodes, batches and compresses every record in Python, on the
interpreter the worker's batches run on, and a relay inside a worker waited on that (a
transaction took 69 ms in a worker against 13.5 ms in a process of its own). librdkafka does all
of it on its own threads, in C: ``produce()`` only copies the record into its queue.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import confluent_kafka

from kstore.errors import BrokerError, ConfigurationError
from kstore.kafka.seam import Fenced, PublishFailed
from kstore.settings import Settings
from kstore.types import Produced

from .connect import client_config

log = logging.getLogger(__name__)

#: A transaction's calls that have not returned this many times their timeout are given up on.
WEDGED_AFTER_TIMEOUTS = 2


class ConfluentShardPublisher:
    """confluent-kafka's :class:`~kstore.relay.publisher.ShardPublisher`: a transactional librdkafka
    producer for one lane of one group's outbox, under the lane's ``transactional_id``."""

    def __init__(self, settings: Settings, transactional_id: str, max_record_bytes: int) -> None:
        self.settings = settings
        self.ident = transactional_id
        base = client_config(settings)
        config = dict(base)
        config.update({
            "transactional.id": self.ident,
            # A record for a deleted topic must wait for it, never recreate it with the broker's defaults
            # (librdkafka's producer would: its default differs from its consumer's).
            "allow.auto.create.topics": False,
            "enable.idempotence": True,
            "acks": "all",
            # Records are sent as soon as they are queued: a transaction's are all queued before
            # its commit flushes them, so waiting to fill batches only adds latency.
            "linger.ms": 0,
            # Only failures call back into Python: each callback takes the interpreter's lock
            # again, and in a busy worker that wait (up to its switch interval) was paid per record.
            "delivery.report.only.error": True,
            "retry.backoff.ms": 10,
            "message.max.bytes": max(1_000_000, max_record_bytes + 65536),
            # A record not delivered by then (its topic does not exist, the brokers are away) fails
            # the transaction, which is aborted and tried again.
            "message.timeout.ms": min(int(settings.connect_timeout_s * 1000), 60_000),
            # A transaction left open by a relay that died is aborted by the broker after this.
            "transaction.timeout.ms": 60_000,
            "error_cb": self._on_error,
            "logger": _TransactionLog(),
        })
        try:
            self._producer: Any = confluent_kafka.Producer(config)
        except confluent_kafka.KafkaException as exc:
            raise ConfigurationError(f"librdkafka configuration: {_text(exc)}") from None
        self._caller = _Caller(f"kstore-txn-{transactional_id}")
        try:
            self._producer.init_transactions(settings.connect_timeout_s)
        except confluent_kafka.KafkaException as exc:
            self.close()
            if _fenced(exc):
                raise Fenced(_text(exc)) from None
            raise BrokerError(f"Kafka at {settings.bootstrap_servers}: {_text(exc)}") from None

    def _on_error(self, err: Any) -> None:
        # Connection trouble is retried by librdkafka; a transaction that fails says so itself.
        log.debug("outbox producer %s: %s", self.ident, err)

    def publish(self, records: Sequence[Produced], mark: Produced, timeout_s: float) -> None:
        """As :meth:`kstore.relay.publisher.ShardPublisher.publish`.

        The transaction runs on the publisher's own thread: a librdkafka transactional call was
        seen to block for good, past its timeout, when the coordinator it had cached went away
        (a broker restart). A transaction that has not returned long after its timeout fails with
        PublishFailed, and its producer is abandoned: the relay's next producer for the lane
        initialises the same transactional id, which fences it and aborts what it left open."""
        if not self._caller.call(functools.partial(self._transaction, records, mark, timeout_s),
                                 WEDGED_AFTER_TIMEOUTS * timeout_s + 1):
            log.warning("outbox producer %s: a transaction did not return in %gs; abandoning the producer",
                        self.ident, WEDGED_AFTER_TIMEOUTS * timeout_s + 1)
            self._producer = None  # still in use by the call that hangs: not purged, not flushed
            raise PublishFailed("librdkafka's transaction did not return after its timeout")

    def _transaction(self, records: Sequence[Produced], mark: Produced, timeout_s: float) -> None:
        producer = self._producer
        refused: list[tuple[int | None, str]] = []  # (row or None for the mark, reason) of records not delivered
        try:
            producer.begin_transaction()
            self._send(records, refused)
            producer.produce(mark.topic, value=mark.value, key=mark.key,
                             partition=-1 if mark.partition is None else mark.partition,
                             on_delivery=functools.partial(_note_refused, refused, None))
            producer.commit_transaction(timeout_s)
        except confluent_kafka.KafkaException as exc:
            if _fenced(exc):
                raise Fenced(_text(exc)) from None
            self._abort(timeout_s)
            rows_refused = [(row, reason) for row, reason in refused if row is not None]
            if rows_refused:
                row, reason = min(rows_refused)
                raise PublishFailed(reason, row) from None
            if refused:
                raise PublishFailed(f"the progress record: {refused[0][1]}") from None
            raise PublishFailed(_text(exc)) from None
        except PublishFailed:
            self._abort(timeout_s)
            raise
        # Committed: librdkafka commits only when every record of the transaction was delivered.

    def _send(self, records: Sequence[Produced], refused: list[tuple[int | None, str]]) -> None:
        producer = self._producer
        for row, r in enumerate(records):
            try:
                producer.produce(r.topic, value=r.value, key=r.key, headers=list(r.headers) or None,
                                 partition=-1 if r.partition is None else r.partition,
                                 on_delivery=functools.partial(_note_refused, refused, row))
            except BufferError:
                producer.poll(0.05)
                raise PublishFailed("librdkafka's queue is full") from None
            except confluent_kafka.KafkaException as exc:
                raise PublishFailed(_text(exc), row) from None

    def _abort(self, timeout_s: float) -> None:
        try:
            self._producer.abort_transaction(timeout_s)
        except Exception as exc:  # the producer is closed next; a new one settles the transaction
            log.debug("aborting %s's transaction failed: %s", self.ident, exc)

    def close(self) -> None:
        caller = getattr(self, "_caller", None)
        if caller is not None:
            caller.stop()
        producer = getattr(self, "_producer", None)
        if producer is not None:
            # librdkafka has no close: what is queued is dropped with the handle (an open
            # transaction is aborted by the next owner's init_transactions, or by the broker).
            # A fenced producer's flush raises its fatal error again: it is done either way.
            self._producer = None
            try:
                producer.purge()
                producer.flush(0)
            except Exception as exc:
                log.debug("closing %s's producer: %s", self.ident, exc)


#: Answers of a transaction coordinator that is not ready yet, each retried by librdkafka until
#: init_transactions' own timeout (a relay's start on a fresh broker meets the first while Kafka
#: loads its transaction log). librdkafka names them in its lines by these texts.
_COORDINATOR_NOT_READY = tuple(confluent_kafka.KafkaError(code).str() for code in (
    confluent_kafka.KafkaError.COORDINATOR_LOAD_IN_PROGRESS, confluent_kafka.KafkaError.COORDINATOR_NOT_AVAILABLE,
    confluent_kafka.KafkaError.NOT_COORDINATOR, confluent_kafka.KafkaError.CONCURRENT_TRANSACTIONS))


class _TransactionLog:
    """The publisher's ``logger``: librdkafka's lines go to this module's logger at their own level,
    but a WARNING that names a coordinator not ready (librdkafka retries it) is INFO. Nothing is
    lost by it: a coordinator that stays away fails init_transactions (or the transaction) at its
    timeout, which the relay reports as a WARNING of its own."""

    def log(self, level: int, msg: str, *args: Any) -> None:
        # The parts, not the formatted line: librdkafka's text may hold a '%'.
        if level == logging.WARNING and any(answer in str(part) for part in (msg, *args)
                                            for answer in _COORDINATOR_NOT_READY):
            level = logging.INFO
        log.log(level, msg, *args)


class _Caller:
    """A daemon thread that runs one call at a time for a caller that waits for it, or gives up
    waiting (the thread is then left to its call; daemon, it never holds the process up)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], _Result] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def call(self, fn: Callable[[], None], timeout_s: float) -> bool:
        """Run ``fn`` there: its exception is raised here; False if it has not returned in ``timeout_s``."""
        result = _Result()
        self._calls.put((fn, result))
        if not result.done.wait(timeout_s):
            self._calls.put(None)  # the thread ends when (if ever) the call returns
            return False
        if result.error is not None:
            raise result.error
        return True

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, result = item
            try:
                fn()
            except BaseException as exc:
                result.error = exc
            result.done.set()


class _Result:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


def _note_refused(refused: list[tuple[int | None, str]], row: int | None, err: Any, _msg: Any) -> None:
    """A record's delivery report (librdkafka sends only failures: delivery.report.only.error)."""
    if err is not None:
        refused.append((row, err.str()))


def _fenced(exc: BaseException) -> bool:
    err = exc.args[0] if exc.args else None
    codes = {confluent_kafka.KafkaError._FENCED, confluent_kafka.KafkaError.PRODUCER_FENCED,
             confluent_kafka.KafkaError.INVALID_PRODUCER_EPOCH,
             confluent_kafka.KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED}
    return bool(err is not None and hasattr(err, "code") and (err.code() in codes or
                                                              (err.fatal() and "fenced" in err.str().lower())))


def _text(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else None
    text = err.str() if err is not None and hasattr(err, "str") else str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
