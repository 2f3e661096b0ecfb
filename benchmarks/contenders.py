"""The contenders (raw clients, loops written by hand, kstore written every way a processor can be),
and the throughput ratios with the targets kstore is held to.

This module is imported by the parent only to know what to run; the code that
runs in each child is named by ``entry`` and imported there alone, so a raw
kafka-python child never loads SQLAlchemy and its peak RSS is its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Contender:
    number: int
    name: str
    label: str
    #: ``module:function`` run in the child process: ``function(config, meter)``.
    entry: str
    #: Writes one row per message into its effects table (checked exactly-once afterwards).
    writes_rows: bool = False
    #: A kstore worker: its stored offsets are checked too.
    kstore: bool = False
    #: Drains the small backlog (``--per-message-txn-messages``): one transaction per message is slow.
    small: bool = False
    #: kstore Settings fields this contender changes from their defaults.
    settings: dict[str, Any] = field(default_factory=dict)
    #: Keeps its own offsets in ``<table>_offsets`` (the hand-written exactly-once loop): checked too.
    own_offsets: bool = False
    #: The SQLAlchemy driver of a kstore contender's DSN (``psycopg`` is psycopg 3); None: the run's DSN as given.
    driver: str | None = None
    #: The Kafka client it consumes with: ``kafka-python`` or ``confluent`` (a kstore contender's ``kafka_client``).
    client: str = "kafka-python"
    #: A raw or hand-written loop's options beyond its libraries' defaults: ``max_poll_records``
    #: (kafka-python), ``consume_batch`` (confluent-kafka's ``consume(num_messages)``), ``page_size``
    #: (``execute_values``' rows per statement; 0: the whole batch in one).
    tuning: dict[str, Any] = field(default_factory=dict)
    #: Measured by its drain alone: it reads no Kafka while timed (the database's own limit), so it has
    #: no latency phase.
    throughput_only: bool = False
    #: What its topics hold: ``bytes`` (stamped filler, ``workload.make_value``) or ``avro`` (records in
    #: the Confluent wire format, registered in the run's schema registry: ``benchmarks.avro``; its
    #: effects table has the record's fields as columns).
    workload: str = "bytes"

    @property
    def kstore_settings(self) -> dict[str, Any]:
        """The Settings fields a kstore contender runs with: its client, then its own changes.

        The client is always given, so ``KSTORE_KAFKA_CLIENT`` cannot put a contender on the
        other client than its name says (the ratios compare loops on the same client)."""
        return {"kafka_client": self.client, **self.settings}


#: The hand-written and raw loops at their best for throughput, as a competent user tunes them:
#: each the fastest of ``python -m benchmarks.sweep --loops 1,2,12,19 --repeat 2 --batches
#: 500,1000,2000,5000 --pages 100,1000,0`` (100,000 messages, 2026-12-02; docs/benchmarks.md,
#: "Tuning the baselines"). kafka-python's defaults are 500 records per poll, psycopg2's 100 rows
#: per ``execute_values``; the at-least-once loops (11, 20) take their exactly-once twins' values.
TUNED_KAFKA_PYTHON: dict[str, Any] = {"max_poll_records": 2000, "page_size": 1000}
#: confluent-kafka's loops also take librdkafka's ``fetch.queue.backoff.ms`` at 10, the fastest of
#: ``--backoffs 1000,100,10`` at 1,000,000 messages (2026-12-03): its default, 1000, stalls a
#: backlog's drain for most of a second each time the local queue fills (the raw loop: 220,000
#: msg/s at 1000, 880,000 at 100, 971,000 at 10; the hand-written loop, bound by its database:
#: 60,000, 61,400, 62,400). kstore's confluent backend asks for 100 itself.
TUNED_CONFLUENT: dict[str, Any] = {"consume_batch": 5000, "page_size": 100, "fetch_queue_backoff_ms": 10}
#: The raw loops write nothing: only their batch size.
RAW_KAFKA_PYTHON: dict[str, Any] = {"max_poll_records": 5000}
RAW_CONFLUENT: dict[str, Any] = {"consume_batch": 2000, "fetch_queue_backoff_ms": 10}


CONTENDERS: tuple[Contender, ...] = (
    Contender(1, "kafka-python", "raw kafka-python loop", "benchmarks.raw_loops:kafka_python",
              tuning=RAW_KAFKA_PYTHON),
    Contender(2, "confluent-kafka", "raw confluent-kafka loop", "benchmarks.confluent_loops:raw",
              client="confluent", tuning=RAW_CONFLUENT),
    Contender(3, "at-least-once", "at-least-once: kafka-python + psycopg2", "benchmarks.baseline_loop:run",
              writes_rows=True),
    Contender(4, "kstore-noop", "kstore, no-op processor", "benchmarks.kstore_loop:noop", kstore=True),
    Contender(5, "kstore-handle", "kstore, INSERT in handle()", "benchmarks.kstore_loop:handle",
              writes_rows=True, kstore=True),
    Contender(6, "kstore-batch", "kstore, bulk INSERT in handle_batch()", "benchmarks.kstore_loop:batch",
              writes_rows=True, kstore=True),
    Contender(7, "kstore-txn-per-msg", "kstore, one transaction per message", "benchmarks.kstore_loop:handle",
              writes_rows=True, kstore=True, small=True, settings={"max_batch_size": 1}),
    # Contender 5 with Processor.defer_inserts off: each INSERT is its own round trip, as before
    # kstore deferred them. A reference: shows what deferring buys.
    Contender(8, "kstore-handle-immediate", "kstore, INSERT in handle(), not deferred",
              "benchmarks.kstore_loop:handle_immediate", writes_rows=True, kstore=True),
    # The cost of metrics: contender 6 with its metrics served on --metrics-port and scraped every second,
    # against contender 6 with nothing recorded at all (kstore always records; this one cannot).
    Contender(9, "kstore-batch-metrics", "kstore, bulk INSERT, /metrics scraped",
              "benchmarks.kstore_loop:batch_scraped", writes_rows=True, kstore=True, settings={"metrics_port": 0}),
    Contender(10, "kstore-batch-unrecorded", "kstore, bulk INSERT, no metrics recorded",
              "benchmarks.kstore_loop:batch_unrecorded", writes_rows=True, kstore=True),
    # The loops a competent user writes by hand, the headline's denominator (12), and the
    # ways of writing a kstore processor measured against it, on psycopg2 and on psycopg 3.
    Contender(11, "at-least-once-values", "at-least-once by hand, execute_values",
              "benchmarks.handwritten:at_least_once", writes_rows=True, tuning=TUNED_KAFKA_PYTHON),
    Contender(12, "exactly-once-by-hand", "exactly-once by hand, execute_values",
              "benchmarks.handwritten:exactly_once", writes_rows=True, own_offsets=True, tuning=TUNED_KAFKA_PYTHON),
    Contender(13, "kstore-text", "kstore, text() INSERT in handle()", "benchmarks.kstore_loop:handle_text",
              writes_rows=True, kstore=True),
    Contender(14, "kstore-copy", "kstore, session.copy_rows() (COPY)", "benchmarks.kstore_loop:copy",
              writes_rows=True, kstore=True),
    Contender(15, "kstore-batch-psycopg3", "kstore, bulk INSERT, psycopg 3", "benchmarks.kstore_loop:batch",
              writes_rows=True, kstore=True, driver="psycopg"),
    Contender(16, "kstore-handle-psycopg3", "kstore, INSERT in handle(), psycopg 3", "benchmarks.kstore_loop:handle",
              writes_rows=True, kstore=True, driver="psycopg"),
    Contender(17, "kstore-text-psycopg3", "kstore, text() in handle(), psycopg 3",
              "benchmarks.kstore_loop:handle_text", writes_rows=True, kstore=True, driver="psycopg"),
    Contender(18, "kstore-copy-psycopg3", "kstore, session.copy_rows(), psycopg 3", "benchmarks.kstore_loop:copy",
              writes_rows=True, kstore=True, driver="psycopg"),
    # The same on confluent-kafka: the hand-written loops (19 is the denominator of this client's
    # ratios) and kstore's worker with kafka_client="confluent".
    Contender(19, "exactly-once-by-hand-confluent", "exactly-once by hand, confluent-kafka",
              "benchmarks.confluent_loops:exactly_once", writes_rows=True, own_offsets=True, client="confluent",
              tuning=TUNED_CONFLUENT),
    Contender(20, "at-least-once-confluent", "at-least-once by hand, confluent-kafka",
              "benchmarks.confluent_loops:at_least_once", writes_rows=True, client="confluent",
              tuning=TUNED_CONFLUENT),
    Contender(21, "kstore-noop-confluent", "kstore, no-op, confluent-kafka", "benchmarks.kstore_loop:noop",
              kstore=True, client="confluent"),
    Contender(22, "kstore-handle-confluent", "kstore, INSERT in handle(), confluent", "benchmarks.kstore_loop:handle",
              writes_rows=True, kstore=True, client="confluent"),
    Contender(23, "kstore-batch-confluent", "kstore, bulk INSERT, confluent-kafka", "benchmarks.kstore_loop:batch",
              writes_rows=True, kstore=True, client="confluent"),
    Contender(24, "kstore-text-confluent", "kstore, text() in handle(), confluent",
              "benchmarks.kstore_loop:handle_text", writes_rows=True, kstore=True, client="confluent"),
    Contender(25, "kstore-copy-confluent", "kstore, copy_rows(), confluent-kafka", "benchmarks.kstore_loop:copy",
              writes_rows=True, kstore=True, client="confluent"),
    # References: contenders 1 and 12 at their libraries' defaults (500 records per poll, 100 rows
    # per statement), as they ran before they were tuned: what tuning buys.
    Contender(26, "kafka-python-defaults", "raw kafka-python loop, defaults", "benchmarks.raw_loops:kafka_python"),
    Contender(27, "exactly-once-by-hand-defaults", "exactly-once by hand, defaults",
              "benchmarks.handwritten:exactly_once", writes_rows=True, own_offsets=True),
    # The limit of the pipelines that COPY: PostgreSQL alone storing the same rows, read and encoded
    # before the clock starts (benchmarks/database_copy.py).
    Contender(28, "database-copy", "PostgreSQL alone: COPY from memory", "benchmarks.database_copy:run",
              writes_rows=True, client="confluent", throughput_only=True),
    # Avro values through a schema registry (benchmarks/avro.py), each decoded and its fields written
    # as the row: contender 19 decoding with confluent-kafka's AvroDeserializer, as its docs show,
    # against contender 23 with value_format = "avro" (kstore's own decoding).
    Contender(29, "exactly-once-by-hand-confluent-avro", "exactly-once by hand, confluent, Avro",
              "benchmarks.avro_loops:exactly_once", writes_rows=True, own_offsets=True, client="confluent",
              tuning=TUNED_CONFLUENT, workload="avro"),
    Contender(30, "kstore-batch-confluent-avro", "kstore, bulk INSERT, confluent, Avro",
              "benchmarks.kstore_loop:batch_avro", writes_rows=True, kstore=True, client="confluent", workload="avro"),
    # The raw confluent-kafka loop building every record's kstore.Message as kstore's fetch thread does,
    # and nothing else: the ceiling of a kstore no-op (21) while kstore builds its messages.
    Contender(31, "confluent-kafka-messages", "raw confluent-kafka loop, kstore Messages",
              "benchmarks.confluent_loops:raw_messages", client="confluent", tuning=RAW_CONFLUENT),
    # Contender 28's rows through kstore's copy_rows (its checks and encoding timed), no Kafka: between
    # the database's own COPY (28) and the worker that COPYs (25).
    Contender(32, "database-copy-rows", "PostgreSQL alone: kstore's copy_rows",
              "benchmarks.database_copy:run_copy_rows", writes_rows=True, client="confluent", throughput_only=True),
)

BY_KEY: dict[str, Contender] = {c.name: c for c in CONTENDERS} | {str(c.number): c for c in CONTENDERS}


@dataclass(frozen=True)
class Ratio:
    """Throughput of ``numerator`` over ``denominator``; ``target`` is kstore's minimum (None: reference)."""

    numerator: int
    denominator: int
    target: float | None
    #: The heading the report prints it under.
    section: str = ""

    @property
    def key(self) -> str:
        return f"{self.numerator}/{self.denominator}"


KAFKA_PYTHON = "kafka-python: against exactly-once by hand (12), raw kafka-python (1), at-least-once (3)"
CONFLUENT = "confluent-kafka: against exactly-once by hand on it (19), raw confluent-kafka (2)"
ACROSS = "across the clients"
DEFAULTS = "the tuned loops against their libraries' defaults"
DATABASE = "the pipelines that COPY against PostgreSQL's own COPY of the same rows (28)"
AVRO = "Avro values through a schema registry: against exactly-once by hand with AvroDeserializer (29)"

#: On each client, every way of writing a kstore processor against the hand-written exactly-once loop
#: on the same client (12, 19: the headlines), and the no-op against the raw loop on the same client;
#: then the ratios across the clients, and what tuning the hand-written loops bought.
RATIOS: tuple[Ratio, ...] = (
    Ratio(6, 12, 1.0, KAFKA_PYTHON),
    Ratio(5, 12, 0.9, KAFKA_PYTHON),
    Ratio(13, 12, 0.6, KAFKA_PYTHON),
    Ratio(14, 12, 2.0, KAFKA_PYTHON),
    Ratio(15, 12, 1.0, KAFKA_PYTHON),
    Ratio(16, 12, 0.9, KAFKA_PYTHON),
    Ratio(17, 12, 0.6, KAFKA_PYTHON),
    Ratio(18, 12, 2.0, KAFKA_PYTHON),
    Ratio(11, 12, None, KAFKA_PYTHON),
    Ratio(3, 12, None, KAFKA_PYTHON),
    Ratio(4, 1, 0.9, KAFKA_PYTHON),
    Ratio(5, 3, 0.8, KAFKA_PYTHON),
    Ratio(6, 3, 1.0, KAFKA_PYTHON),
    Ratio(8, 3, None, KAFKA_PYTHON),
    Ratio(9, 10, 0.95, KAFKA_PYTHON),
    Ratio(23, 19, 1.0, CONFLUENT),
    Ratio(22, 19, 1.0, CONFLUENT),
    Ratio(24, 19, 1.0, CONFLUENT),
    Ratio(25, 19, 2.0, CONFLUENT),
    Ratio(20, 19, None, CONFLUENT),
    Ratio(21, 2, 0.7, CONFLUENT),
    Ratio(31, 2, None, CONFLUENT),
    Ratio(21, 31, None, CONFLUENT),
    Ratio(25, 14, 1.3, ACROSS),
    Ratio(2, 1, None, ACROSS),
    Ratio(19, 12, None, ACROSS),
    Ratio(21, 4, None, ACROSS),
    Ratio(1, 26, None, DEFAULTS),
    Ratio(12, 27, None, DEFAULTS),
    Ratio(6, 27, None, DEFAULTS),
    Ratio(25, 28, 0.85, DATABASE),
    Ratio(32, 28, None, DATABASE),
    Ratio(25, 32, None, DATABASE),
    Ratio(14, 28, None, DATABASE),
    Ratio(18, 28, None, DATABASE),
    Ratio(30, 29, 1.0, AVRO),
    Ratio(29, 19, None, AVRO),
    Ratio(30, 23, None, AVRO),
)

#: The raw loops, the ceilings the report names for each client.
CEILINGS = {"kafka-python": 1, "confluent": 2}

#: These kstore contenders' p99 latency may be no higher than the hand-written exactly-once loop's
#: on the same client (the key).
LATENCY_JUDGED: dict[int, tuple[int, ...]] = {12: (5, 6, 13, 14), 19: (22, 23, 24, 25)}

#: The memory target for the kstore contenders on the full 1,000,000-message run.
RSS_TARGET_MB = 300


def select(only: str | None) -> list[Contender]:
    """The contenders named (or numbered) in a comma-separated ``--only``, in their fixed order."""
    if not only:
        return list(CONTENDERS)
    keys = [k.strip() for k in only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        names = ", ".join(f"{c.number}={c.name}" for c in CONTENDERS)
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}; choose from {names}")
    wanted = {BY_KEY[k].number for k in keys}
    return [c for c in CONTENDERS if c.number in wanted]
