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


CONTENDERS: tuple[Contender, ...] = (
    Contender(1, "kafka-python", "raw kafka-python loop", "benchmarks.raw_loops:kafka_python"),
    Contender(2, "confluent-kafka", "raw confluent-kafka loop", "benchmarks.raw_loops:confluent"),
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
              "benchmarks.handwritten:at_least_once", writes_rows=True),
    Contender(12, "exactly-once-by-hand", "exactly-once by hand, execute_values",
              "benchmarks.handwritten:exactly_once", writes_rows=True, own_offsets=True),
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
)

BY_KEY: dict[str, Contender] = {c.name: c for c in CONTENDERS} | {str(c.number): c for c in CONTENDERS}


@dataclass(frozen=True)
class Ratio:
    """Throughput of ``numerator`` over ``denominator``; ``target`` is kstore's minimum (None: reference)."""

    numerator: int
    denominator: int
    target: float | None

    @property
    def key(self) -> str:
        return f"{self.numerator}/{self.denominator}"


#: The headline first: every way of writing a kstore processor against the hand-written
#: exactly-once loop (12); then the no-op against raw kafka-python, and the ratios to the at-least-once loop (3).
RATIOS: tuple[Ratio, ...] = (
    Ratio(6, 12, 1.0),
    Ratio(5, 12, 0.9),
    Ratio(13, 12, 0.6),
    Ratio(14, 12, 2.0),
    Ratio(15, 12, 1.0),
    Ratio(16, 12, 0.9),
    Ratio(17, 12, 0.6),
    Ratio(18, 12, 2.0),
    Ratio(11, 12, None),
    Ratio(3, 12, None),
    Ratio(4, 1, 0.9),
    Ratio(5, 3, 0.8),
    Ratio(6, 3, 1.0),
    Ratio(2, 1, None),
    Ratio(8, 3, None),
    Ratio(9, 10, 0.95),
)

#: These kstore contenders' p99 latency may be no higher than the hand-written exactly-once loop's.
LATENCY_BASELINE = 12
LATENCY_JUDGED = (5, 6, 13, 14)

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
