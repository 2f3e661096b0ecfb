"""The outbox relay's publisher on kafka-python: a transport that satisfies
:class:`kstore.relay.publisher.ShardPublisher`, a transactional producer per outbox lane (one shard,
or several: :mod:`kstore.relay.lanes`).

**Progress lives in the Kafka transaction.** Each transaction that publishes a lane's rows also
sends the lane's progress record, given already encoded (:mod:`kstore.relay.progress` owns its
format and reads it back): the records and that mark commit together or not at all.

**Fencing.** The producer's ``transactional_id`` is stable per lane: ``init_transactions()`` by a
new owner aborts a paused owner's open transaction and fences its producer, whose next send or
commit fails. Together with the lease's epoch in the database (:mod:`kstore.relay.leases`), a
zombie relay can publish nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kafka import KafkaProducer
from kafka.errors import (
    InvalidProducerEpochError,
    KafkaError,
    ProducerFencedError,
    TransactionalIdAuthorizationFailedError,
)

from kstore.errors import BrokerError
from kstore.kafka.seam import Fenced, PublishFailed
from kstore.settings import Settings
from kstore.types import Produced

from .connect import _open, client_config

log = logging.getLogger(__name__)

#: Between the retries of a transactional request the broker answers "try again" (the last
#: transaction's markers are still being written): kafka-python's 100 ms would be paid on
#: nearly every transaction, which is most of the latency from a batch's commit to a reader.
RETRY_BACKOFF_MS = 10


class KafkaPythonShardPublisher:
    """kafka-python's :class:`~kstore.relay.publisher.ShardPublisher`: a transactional producer for one
    lane of one group's outbox, under the lane's ``transactional_id``."""

    def __init__(self, settings: Settings, transactional_id: str, max_record_bytes: int) -> None:
        self.settings = settings
        self.ident = transactional_id
        config = {k: v for k, v in client_config(settings).items() if k in KafkaProducer.DEFAULT_CONFIG}
        config.update(
            transactional_id=self.ident,
            # A record for a deleted topic must wait for it, never recreate it with the broker's defaults.
            allow_auto_create_topics=False,
            enable_idempotence=True,
            acks="all",
            retry_backoff_ms=RETRY_BACKOFF_MS,
            # A request holds a whole transaction's records for a partition; one record may be
            # as large as the outbox allows.
            max_request_size=max(config.get("max_request_size", 1048576), max_record_bytes + 65536),
            max_block_ms=int(settings.connect_timeout_s * 1000),
            # A transaction left open by a relay that died is aborted by the broker after this.
            transaction_timeout_ms=60_000,
        )
        self._producer: Any = _open(settings, config, lambda: KafkaProducer(**config))
        try:
            self._producer.init_transactions()
        except KafkaError as exc:
            self.close()
            raise _broker(settings, exc) from None

    def publish(self, records: Sequence[Produced], mark: Produced, timeout_s: float) -> None:
        """Publish ``records``, in order, then the progress record ``mark``, in one transaction.

        Raises :class:`Fenced` (this producer is done) or :class:`PublishFailed` (the transaction
        was aborted or its outcome is unknown: close this producer and make a new one, which
        settles it, before the relay reads its progress again).
        """
        producer = self._producer
        try:
            producer.begin_transaction()
            futures: list[tuple[int | None, Any]] = [
                (row, producer.send(r.topic, value=r.value, key=r.key, headers=list(r.headers) or None,
                                    partition=r.partition)) for row, r in enumerate(records)]
            futures.append((None, producer.send(mark.topic, value=mark.value, key=mark.key, partition=mark.partition)))
            producer.flush(timeout=timeout_s)
            # A row the broker refused first (kafka-python may still be retrying the others of its
            # request), then any row not acknowledged in time.
            for row, future in futures:
                if future.is_done and future.failed():
                    _result(future, row)
            for row, future in futures:
                _result(future, row)
            self._bounded("commit", lambda tm: tm.begin_commit(), producer.commit_transaction, timeout_s)
        except (ProducerFencedError, InvalidProducerEpochError, TransactionalIdAuthorizationFailedError) as exc:
            raise Fenced(str(exc)) from None
        except PublishFailed:
            self._abort()
            raise
        except KafkaError as exc:
            if "fenced" in str(exc).lower() or "BUMPING_PRODUCER_EPOCH" in str(exc):
                raise Fenced(str(exc)) from None
            self._abort()
            raise PublishFailed(_first_line(exc)) from None

    def _bounded(self, what: str, start: Callable[[Any], Any], public: Callable[[], Any], timeout_s: float) -> None:
        """A transactional request, waited for at most ``timeout_s``: kafka-python's own
        ``commit_transaction`` and ``abort_transaction`` wait for
        ever, and one that lost its broker mid-request (a restart) was seen never to end, holding
        its lane (and the lease the relay goes on renewing) for good. This starts the request as
        those methods do and bounds the wait; an unknown kafka-python without those parts gets the
        plain call. A timeout fails the transaction: its producer is closed, and a new one settles
        it (``init_transactions``) and reads the progress again."""
        producer = self._producer
        manager, sender = getattr(producer, "_transaction_manager", None), getattr(producer, "_sender", None)
        if manager is None or sender is None:
            public()
            return
        result = start(manager)
        sender.wakeup()
        if not result.wait(timeout_ms=int(timeout_s * 1000)):
            raise PublishFailed(f"no answer to {what} within {timeout_s:g}s")

    def _abort(self) -> None:
        try:
            self._bounded("abort", lambda tm: tm.begin_abort(), self._producer.abort_transaction,
                          self.settings.connect_timeout_s)
        except Exception as exc:  # the producer is closed next; a new one settles the transaction
            log.debug("aborting %s's transaction failed: %s", self.ident, exc)

    def close(self) -> None:
        try:
            self._producer.close(timeout=5)
        except Exception as exc:
            log.debug("closing %s's producer failed: %s", self.ident, exc)


def _result(future: Any, row: int | None) -> Any:
    """A sent record's metadata, or :class:`PublishFailed` naming it (None: the progress record)."""
    what = "the progress record" if row is None else "a record"
    if not future.is_done:
        raise PublishFailed(f"{what} was not acknowledged in time")
    if future.failed():
        exc = future.exception
        if isinstance(exc, (ProducerFencedError, InvalidProducerEpochError)):
            # Not the record's fault: another producer took the lane's transactional id.
            raise Fenced(str(exc))
        reason = f"{type(exc).__name__}: {_first_line(exc)}"
        raise PublishFailed(reason if row is not None else f"{what}: {reason}", row)
    return future.value


def _broker(settings: Settings, exc: BaseException) -> BrokerError:
    return BrokerError(f"Kafka at {settings.bootstrap_servers}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

