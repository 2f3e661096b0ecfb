"""The loops on confluent-kafka: the raw read loops (2, 31) and the ones a competent user writes by hand.

Kept apart from the kafka-python loops so a confluent-kafka child never loads
kafka-python (its peak RSS is its own). The hand-written loops are the
kafka-python ones (``handwritten``) on this client, with psycopg2's
``execute_values``:

- **at-least-once** (20): per batch the rows, the database COMMIT, then a
  synchronous ``consumer.commit()`` of the consumed positions. A crash between
  the two repeats the batch's rows.
- **exactly-once** (19): per batch the rows and one ``INSERT ... ON CONFLICT DO
  UPDATE`` of the batch's next offsets into the loop's own offsets table, one
  COMMIT, nothing committed to Kafka; in ``on_assign`` it reads the stored
  offsets and assigns each partition at its own (from the beginning if none).

Batches: ``consume(num_messages=N, timeout=1.0)`` while draining, with ``N`` from
``config["tuning"]["consume_batch"]``. In the latency phase ``consume(N)`` would
wait for ``N`` messages or its timeout, so the raw loop calls ``poll()`` per
message, and the hand-written loops wait for the first message only and take
what librdkafka already holds with it (``consume(1, 1.0)``, then ``consume(N - 1, 0)``):
one transaction per message cannot keep up with 5,000 messages/s.
"""

from __future__ import annotations

import functools
import gc
import operator
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from .meter import Meter, signal_ready

#: ``consume(num_messages)`` when the contender's tuning does not say (confluent-kafka's own default is 1).
DEFAULT_CONSUME_BATCH = 500
#: Seconds ``consume()`` and ``poll()`` wait when nothing is there.
TIMEOUT_S = 1.0


def consume_batch(config: dict[str, Any]) -> int:
    return int(config.get("tuning", {}).get("consume_batch", DEFAULT_CONSUME_BATCH))


def consumer_for(config: dict[str, Any], on_assign: Callable[[Any, list[TopicPartition]], None]) -> Consumer:
    """A confluent-kafka consumer as a hand-written loop makes it: a fresh group from the start
    of the topic, no auto-commit (each loop decides what to commit), subscribed."""
    tuning = config.get("tuning", {})
    consumer = Consumer({
        "bootstrap.servers": config["bootstrap"],
        "group.id": config["group"],
        "client.id": f"bench-{config['contender']}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        # librdkafka stops fetching a partition this long once its queue is full (1000 ms unless
        # tuned: a drained backlog then comes in bursts; see docs/benchmarks.md).
        **({"fetch.queue.backoff.ms": tuning["fetch_queue_backoff_ms"]} if "fetch_queue_backoff_ms" in tuning else {}),
    })
    consumer.subscribe([config["topic"]], on_assign=on_assign)
    return consumer


def _ready(config: dict[str, Any]) -> Callable[[Any, list[TopicPartition]], None]:
    ready_file = config.get("ready_file")

    def on_assign(_consumer: Any, partitions: list[TopicPartition]) -> None:
        if partitions:
            signal_ready(ready_file)

    return on_assign


def fetcher(consumer: Consumer, config: dict[str, Any], latency: bool, per_message: bool) -> Callable[[], list[Any]]:
    """The loop's fetch: ``consume(N, timeout)`` while draining; in the latency phase ``poll()``
    (``per_message``) or the first message waited for and what came with it."""
    batch = consume_batch(config)
    if not latency:
        return lambda: consumer.consume(num_messages=batch, timeout=TIMEOUT_S)
    if per_message:
        def one() -> list[Any]:
            msg = consumer.poll(TIMEOUT_S)
            return [] if msg is None else [msg]
        return one

    def first_and_the_rest() -> list[Any]:
        msgs: list[Any] = consumer.consume(num_messages=1, timeout=TIMEOUT_S)
        if msgs and batch > 1:
            msgs += consumer.consume(num_messages=batch - 1, timeout=0)
        return msgs

    return first_and_the_rest


def _checked(msgs: list[Any]) -> list[Any]:
    for msg in msgs:
        if msg.error():
            raise RuntimeError(f"confluent-kafka: {msg.error()}")
    return msgs


def raw(config: dict[str, Any], meter: Meter) -> None:
    """Contender 2: reads every message's value and does nothing with it."""

    def read(msgs: list[Any]) -> Iterable[bytes]:
        nbytes = 0
        for msg in _checked(msgs):
            nbytes += len(msg.value())
        return (m.value() for m in msgs)

    _read_loop(config, meter, read)


def raw_messages(config: dict[str, Any], meter: Meter) -> None:
    """Contender 31: the raw loop that turns every record into a :class:`kstore.Message`, as kstore's
    fetch thread does (``to_messages``, the collector tuned as in a worker), and does nothing more:
    the most a kstore processor that does nothing could drain on this client while kstore builds
    its messages, in one thread."""
    from confluent_kafka import Message

    from kstore.engine.worker import tune_collector
    from kstore.kafka.confluent.consumer import to_messages

    is_error = functools.partial(operator.is_not, None)
    topic = config["topic"]
    # The collector tuned as a worker tunes it: at Python's defaults the young collections that
    # millions of new Messages trigger cost about as much as building them.
    gc.freeze()
    tune_collector()

    def build(msgs: list[Any]) -> Iterable[bytes]:
        if any(map(is_error, map(Message.error, msgs))):  # a C loop, as kstore's fetch checks them
            _checked(msgs)
        return (m.value for m in to_messages(msgs, topic))

    _read_loop(config, meter, build)


def _read_loop(config: dict[str, Any], meter: Meter, take: Callable[[list[Any]], Iterable[bytes]]) -> None:
    """The raw loops' shape: fetch (``poll()`` per message in the latency phase), ``take`` each batch
    (it returns their values, stamped in the latency phase), until every message is in."""
    consumer = consumer_for(config, _ready(config))
    fetch = fetcher(consumer, config, meter.latency, per_message=True)
    try:
        while True:
            msgs = fetch()
            if not msgs:
                continue
            meter.started()
            values = take(msgs)
            if meter.latency:
                meter.stamp(values)
            if meter.counted(len(msgs)):
                meter.finished()
                return
    finally:
        consumer.close()


Rows = list[tuple[int, int, bytes]]
#: ``{(topic, partition): next offset}`` of a batch.
Ends = dict[tuple[str, int], int]


def drain(consumer: Consumer, fetch: Callable[[], list[Any]], meter: Meter,
          write: Callable[[Ends, Rows], None], after: Callable[[], None] | None = None) -> None:
    """The hand-written loops' shape (``handwritten.drain`` on this client): fetch, ``write`` the
    batch's rows and commit them, stamp them done, ``after()``, until every message is in."""
    while True:
        msgs = fetch()
        if not msgs:
            continue
        meter.started()
        rows: Rows = []
        ends: Ends = {}
        for msg in _checked(msgs):
            partition, offset = msg.partition(), msg.offset()
            rows.append((partition, offset, msg.value()))
            ends[(msg.topic(), partition)] = offset + 1
        write(ends, rows)
        if meter.batch_done(rows, after):
            return


def at_least_once(config: dict[str, Any], meter: Meter) -> None:
    import psycopg2

    from .handsql import insert_sql, page_size, write_values

    conn = psycopg2.connect(**config["conninfo"])
    consumer = consumer_for(config, _ready(config))
    fetch = fetcher(consumer, config, meter.latency, per_message=False)
    sql, page = insert_sql(config), page_size(config)

    def write(_ends: Ends, rows: Rows) -> None:
        write_values(cur, sql, rows, page)
        conn.commit()

    def commit_to_kafka() -> None:
        consumer.commit(asynchronous=False)

    try:
        with conn.cursor() as cur:
            drain(consumer, fetch, meter, write, after=commit_to_kafka)
    finally:
        consumer.close()
        conn.close()


def exactly_once(config: dict[str, Any], meter: Meter) -> None:
    import psycopg2

    from .handsql import create_offsets_table, insert_sql, page_size, stored_offsets, upsert_sql, write_values

    conn = psycopg2.connect(**config["conninfo"])
    create_offsets_table(conn, config)
    sql, upsert, page = insert_sql(config), upsert_sql(config), page_size(config)
    group = config["group"]
    ready_file = config.get("ready_file")

    def on_assign(consumer: Any, partitions: list[TopicPartition]) -> None:
        stored = stored_offsets(conn, config)
        for tp in partitions:
            tp.offset = stored.get((tp.topic, tp.partition), OFFSET_BEGINNING)
        consumer.assign(partitions)
        if partitions:
            signal_ready(ready_file)

    consumer = consumer_for(config, on_assign)
    fetch = fetcher(consumer, config, meter.latency, per_message=False)

    def write(ends: Ends, rows: Rows) -> None:
        write_values(cur, sql, rows, page)
        write_values(cur, upsert, [(group, t, p, n) for (t, p), n in ends.items()], 0)
        conn.commit()

    try:
        with conn.cursor() as cur:
            drain(consumer, fetch, meter, write)
    finally:
        consumer.close()
        conn.close()
