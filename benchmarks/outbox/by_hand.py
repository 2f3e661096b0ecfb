"""Contenders 2 and 3: Kafka -> PostgreSQL -> Kafka written by hand, kafka-python and psycopg2 only.

Both consume with kafka-python (``max_poll_records`` raised from 500, auto-commit off) and
keep their offsets in the database: per poll, one transaction holds the effect rows
(``execute_values``), one offsets row per partition (``INSERT ... ON CONFLICT DO UPDATE``)
and, for contender 3, the outbox rows; on assignment each partition is sought to its stored
offset. They differ in how the output records reach Kafka:

- **send after commit** (2): after COMMIT, ``KafkaProducer.send`` per record and one
  ``flush()`` per poll, a plain producer (kafka-python's defaults: idempotent, acks=all).
  The effects are exactly once; the records are not: a crash between COMMIT and the flush
  loses them (the offsets are already stored), and nothing sends them again.
- **polled outbox** (3): the records go into an outbox table (``id BIGSERIAL``) in the same
  transaction; a thread polls ``SELECT ... WHERE id > last ORDER BY id`` every 100 ms, sends
  what it found with a plain producer, flushes, and deletes those rows. At least once: a crash
  between the flush and the DELETE sends the rows again. (Ordering by a sequence is safe here
  only because one connection writes the outbox, so ids commit in order; two writers can
  commit a lower id after a poller read a higher one, and the poller then skips it.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg2
from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from psycopg2.extras import execute_values

from ..meter import Meter, signal_ready
from .records import Stamps, output_record

#: kafka-python's default is 500; larger polls mean fewer, larger transactions when draining.
MAX_POLL_RECORDS = 2000
#: The polled outbox's period, and the most rows it publishes per poll.
POLL_INTERVAL_S = 0.1
POLL_LIMIT = 5000

Out = list[tuple[bytes, bytes]]


class _SeekToStored(ConsumerRebalanceListener):  # type: ignore[misc]
    """On assignment, seek each partition to the offset stored in the database (or 0)."""

    def __init__(self, consumer: KafkaConsumer, config: dict[str, Any]) -> None:
        self.consumer = consumer
        self.config = config
        self.conn = psycopg2.connect(**config["conninfo"])

    def on_partitions_assigned(self, assigned: Any) -> None:
        with self.conn, self.conn.cursor() as cur:
            cur.execute(f"SELECT partition_id, next_offset FROM {self.config['table']}_offsets WHERE topic = %s",
                        (self.config["topic"],))
            stored = dict(cur.fetchall())
        for tp in assigned:
            self.consumer.seek(tp, stored.get(tp.partition, 0))
        if assigned:
            signal_ready(self.config.get("ready_file"))

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass


def _loop(config: dict[str, Any], meter: Meter, stamps: Stamps, in_transaction: Callable[[Any, Out], None],
          after_commit: Callable[[Out], None]) -> None:
    """Poll; per poll, one transaction (effects, ``in_transaction``, offsets); ``after_commit``."""
    table = config["table"]  # made by the benchmark (letters, digits, _), never user input
    effects = f"INSERT INTO {table} (partition_id, kafka_offset, payload) VALUES %s"
    offsets = (f"INSERT INTO {table}_offsets (topic, partition_id, next_offset) VALUES %s "
               "ON CONFLICT (topic, partition_id) DO UPDATE SET next_offset = EXCLUDED.next_offset")
    conn = psycopg2.connect(**config["conninfo"])
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table}_offsets (topic text, partition_id integer, "
                    "next_offset bigint NOT NULL, PRIMARY KEY (topic, partition_id))")
    consumer = KafkaConsumer(
        bootstrap_servers=config["bootstrap"], group_id=config["group"], client_id=f"bench-{config['contender']}",
        enable_auto_commit=False, auto_offset_reset="earliest", max_poll_records=MAX_POLL_RECORDS,
    )
    listener = _SeekToStored(consumer, config)
    consumer.subscribe([config["topic"]], listener=listener)
    try:
        with conn.cursor() as cur:
            while True:
                batches = consumer.poll(timeout_ms=1000)
                if not batches:
                    continue
                meter.started()
                stamps.started()
                records = [r for rs in batches.values() for r in rs]
                out = [output_record(r.partition, r.offset, r.value) for r in records]
                execute_values(cur, effects, [(r.partition, r.offset, r.value) for r in records])
                in_transaction(cur, out)
                execute_values(cur, offsets, [(tp.topic, tp.partition, rs[-1].offset + 1)
                                              for tp, rs in batches.items()])
                conn.commit()
                stamps.add((r.partition, r.offset) for r in records)
                after_commit(out)
                if meter.counted(len(records)):
                    meter.finished()
                    return
    finally:
        consumer.close(autocommit=False)
        listener.conn.close()
        conn.close()


def _send_all(producer: KafkaProducer, topic: str, out: Out) -> None:
    """Send, flush, and make sure each was acknowledged (a failure raises)."""
    futures = [producer.send(topic, key=key, value=value) for key, value in out]
    producer.flush()
    for future in futures:
        future.get(timeout=0)


def send_after_commit(config: dict[str, Any], meter: Meter) -> None:
    producer = KafkaProducer(bootstrap_servers=config["bootstrap"], client_id=f"bench-{config['contender']}-out")
    stamps = Stamps()
    try:
        _loop(config, meter, stamps, lambda cur, out: None, lambda out: _send_all(producer, config["out_topic"], out))
    finally:
        producer.close()
    stamps.save(config["stamps_file"])


def _poller(config: dict[str, Any], expected: int, failed: list[BaseException]) -> None:
    """Every ``POLL_INTERVAL_S``: send the outbox's rows after the last one sent, then delete them."""
    outbox = f"{config['table']}_outbox"
    producer = KafkaProducer(bootstrap_servers=config["bootstrap"], client_id=f"bench-{config['contender']}-out")
    conn = psycopg2.connect(**config["conninfo"])
    conn.autocommit = True  # each statement its own transaction: no snapshot held between polls
    last, published = 0, 0
    try:
        with conn.cursor() as cur:
            while published < expected:
                cur.execute(f"SELECT id, key, value FROM {outbox} WHERE id > %s ORDER BY id LIMIT %s",
                            (last, POLL_LIMIT))
                rows = cur.fetchall()
                if rows:
                    _send_all(producer, config["out_topic"], [(bytes(k), bytes(v)) for _, k, v in rows])
                    last = rows[-1][0]
                    cur.execute(f"DELETE FROM {outbox} WHERE id <= %s", (last,))
                    published += len(rows)
                if len(rows) < POLL_LIMIT:
                    time.sleep(POLL_INTERVAL_S)
    except BaseException as exc:
        failed.append(exc)
        raise
    finally:
        producer.close()
        conn.close()


def polled_outbox(config: dict[str, Any], meter: Meter) -> None:
    outbox = f"{config['table']}_outbox"
    conn = psycopg2.connect(**config["conninfo"])
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {outbox} (id bigserial PRIMARY KEY, key bytea, value bytea)")
    conn.close()
    failed: list[BaseException] = []
    poller = threading.Thread(target=_poller, args=(config, meter.expected, failed), name="outbox-poller",
                              daemon=True)
    poller.start()

    def insert(cur: Any, out: Out) -> None:
        execute_values(cur, f"INSERT INTO {outbox} (key, value) VALUES %s", out)

    stamps = Stamps()
    _loop(config, meter, stamps, insert, lambda out: None)
    poller.join()  # the contender is done when its outbox is published
    stamps.save(config["stamps_file"])
    if failed:
        raise RuntimeError(f"the outbox poller failed: {failed[0]!r}")
