"""One outbox benchmark run: the input backlog, then each contender's two phases.

Per contender and phase, a fresh consumer group, effects table and output topic:

* **throughput**: drain the pre-filled backlog; the clock runs from the contender's first
  batch in hand until the reader has seen the last output record;
* **steady**: a fresh input topic produced at ``--rate`` once the contender holds its
  partitions; each record's commit-to-visible latency (:mod:`.records` says how it is taken).

The reader (:mod:`.reader`) is started, and connected, before the contender. After each phase
the effect rows, the stored offsets and the whole output topic are checked exactly once; the
run stops with an error at the first contender that fails.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kstore import Settings, migrate

from .. import effects
from .. import workload as side_by_side
from ..meter import latency_stats
from ..noise import WARN_CORES, Noise
from ..runner import kept_up, libpq_params, say
from ..spawn import BenchmarkError, Child
from . import checks, workload
from .records import load

READY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Contender:
    number: int
    name: str
    label: str
    #: ``module:function`` run in the child process (``benchmarks.child``): ``function(config, meter)``.
    entry: str
    kstore: bool = False
    #: Keeps an outbox table of its own (``<table>_outbox``), which must be empty at the end.
    outbox_table: bool = False


CONTENDERS: tuple[Contender, ...] = (
    Contender(1, "kstore-produce", "kstore, self.produce(), relay in the worker",
              "benchmarks.outbox.kstore_side:run", kstore=True),
    Contender(2, "send-after-commit", "by hand: COMMIT, then a plain producer",
              "benchmarks.outbox.by_hand:send_after_commit"),
    Contender(3, "polled-outbox", "by hand: outbox table polled every 100 ms",
              "benchmarks.outbox.by_hand:polled_outbox", outbox_table=True),
)


@dataclass(frozen=True)
class Options:
    messages: int = 100_000
    partitions: int = 8
    size: int = 100
    rate: float = 5000.0
    seconds: float = 20.0
    warmup: float = 2.0
    broker_warmup: float = 5.0
    out: Path = Path("benchmarks/results")
    timeout: float = 1800.0


class OutboxRunner:
    """Runs the contenders against one broker and one database; see the module docstring."""

    def __init__(self, opts: Options, bootstrap: str, dsn: str, service_pids: list[int]) -> None:
        self.opts = opts
        self.bootstrap = bootstrap
        self.dsn = dsn
        self.noise = Noise(service_pids)
        self.run_id = uuid.uuid4().hex[:8]
        self.engine = sa.create_engine(dsn)
        self.settings = Settings.from_env(dsn=dsn)
        self.logs = opts.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.topics: list[str] = []
        self.backlog: tuple[str, dict[int, int]] | None = None

    def prepare(self) -> None:
        """kstore's tables, and the backlog every contender drains."""
        migrate(self.settings)
        topic = self._new_topic("backlog")
        started = time.monotonic()
        n = self.opts.messages
        say(f"filling {topic} with {n:,} JSON messages of {self.opts.size} bytes on {self.opts.partitions} partitions")
        workload.prefill(self.bootstrap, topic, self.opts.partitions, n, self.opts.size)
        ends = side_by_side.end_offsets(self.bootstrap, topic, self.opts.partitions)
        if sum(ends.values()) != n:
            raise BenchmarkError(f"{topic} holds {sum(ends.values())} messages, expected {n}")
        say(f"filled in {time.monotonic() - started:.1f} s")
        self.backlog = topic, ends

    def _new_topic(self, what: str) -> str:
        topic = f"bench-{self.run_id}-{what}"
        side_by_side.create_topic(self.bootstrap, topic, self.opts.partitions)
        self.topics.append(topic)
        return topic

    def warm_up(self, c: Contender) -> None:
        """An unreported steady phase: the first contender would otherwise meet a cold broker."""
        say(f"warming up the broker: {self.opts.broker_warmup:g} s of {c.name} at {self.opts.rate:,.0f} msg/s "
            "(not reported)")
        self.phase(c, "steady", seconds=self.opts.broker_warmup, name="warmup")

    def run(self, c: Contender) -> dict[str, Any]:
        throughput = self.phase(c, "throughput")
        steady = self.phase(c, "steady")
        return {"number": c.number, "name": c.name, "label": c.label, "throughput": throughput, "steady": steady}

    def phase(self, c: Contender, phase: str, seconds: float | None = None, name: str | None = None) -> dict[str, Any]:
        """One phase of one contender, checked; raises :class:`BenchmarkError` if it fails."""
        tag = f"{c.number}-{c.name}-{name or phase}"
        if phase == "throughput":
            assert self.backlog is not None
            topic, ends = self.backlog
            messages = self.opts.messages
        else:
            topic = self._new_topic(f"in-{tag}")
            messages = max(1, round(self.opts.rate * (seconds or self.opts.seconds)))
        config = self._config(c, phase, tag, topic, messages)
        reader = Child(self._reader_config(config, tag), self.logs / f"{tag}-reader.log")
        child: Child | None = None
        try:
            reader.wait_ready(Path(self.logs / f"{tag}-reader.ready"), READY_TIMEOUT_S)
            self.noise.start()
            child = Child(config, self.logs / f"{tag}.log")
            took = None
            if phase == "steady":
                child.wait_ready(Path(config["ready_file"]), READY_TIMEOUT_S)
                took = workload.produce_at_rate(self.bootstrap, topic, self.opts.partitions, messages,
                                                self.opts.size, self.opts.rate)
            outcome = child.wait(self.opts.timeout)
            reader.wait(120)
        finally:
            reader.kill()
            if child is not None:
                child.kill()
        noise = self._noise()
        if phase == "steady":
            ends = side_by_side.end_offsets(self.bootstrap, topic, self.opts.partitions)
        check = self._check(c, config, ends)
        result = self._measure(config, messages, phase)
        result.update(cpu_s=outcome.cpu_s, peak_rss_mb=outcome.peak_rss_mb, noise=noise, exactly_once=check,
                      committed_msgs_per_s=outcome.result["throughput"], produce_s=took)
        if "kstore_settings" in outcome.result:
            result["kstore_settings"] = outcome.result["kstore_settings"]
        self._say(phase, result)
        return result

    def _config(self, c: Contender, phase: str, tag: str, topic: str, messages: int) -> dict[str, Any]:
        table = f"bench_{self.run_id}_{tag.replace('-', '_')}"
        effects.drop_table(self.engine, table)
        effects.create_table(self.engine, table)
        effects.checkpoint(self.engine)  # the previous phase's dirty pages are not this one's cost
        (self.logs / f"{tag}.ready").unlink(missing_ok=True)
        return {
            "contender": c.name, "entry": c.entry, "phase": phase, "bootstrap": self.bootstrap, "topic": topic,
            "out_topic": self._new_topic(f"out-{tag}"), "partitions": self.opts.partitions,
            "group": f"bench-{self.run_id}-{tag}", "messages": messages, "table": table, "dsn": self.dsn,
            "conninfo": libpq_params(self.dsn), "ready_file": str(self.logs / f"{tag}.ready"),
            "stamps_file": str(self.logs / f"{tag}.stamps.json"), "result_file": str(self.logs / f"{tag}.json"),
        }

    def _reader_config(self, config: dict[str, Any], tag: str) -> dict[str, Any]:
        ready = self.logs / f"{tag}-reader.ready"
        ready.unlink(missing_ok=True)
        return {
            "contender": "reader", "entry": "benchmarks.outbox.reader:run", "phase": "read",
            "bootstrap": self.bootstrap, "topic": config["out_topic"], "partitions": self.opts.partitions,
            "group": config["group"], "messages": config["messages"], "ready_file": str(ready),
            "stamps_file": str(self.logs / f"{tag}-reader.stamps.json"),
            "result_file": str(self.logs / f"{tag}-reader.json"),
        }

    def _measure(self, config: dict[str, Any], messages: int, phase: str) -> dict[str, Any]:
        """Throughput until visible, and (steady phase) commit-to-visible latency, from the two stamp files."""
        mine, committed = load(Path(config["stamps_file"]))
        theirs, visible = load(Path(str(config["stamps_file"]).replace(".stamps", "-reader.stamps")))
        unknown = set(visible) - set(committed)
        if unknown:
            raise BenchmarkError(f"{config['contender']}: {len(unknown)} records seen that were never committed")
        seconds = (theirs["last_ns"] - mine["first_ns"]) / 1e9
        out: dict[str, Any] = {"messages": messages, "seconds": seconds, "visible_msgs_per_s": messages / seconds,
                               "reader_repeats": theirs["repeated"]}
        if phase == "steady":
            srcs = list(visible)
            lat = latency_stats([committed[s] for s in srcs], [visible[s] for s in srcs],
                                int(self.opts.warmup * 1e9))
            lat["kept_up"] = kept_up(messages, self.opts.rate, lat["span_s"])
            out.update(rate=self.opts.rate, latency=lat)
        return out

    def _check(self, c: Contender, config: dict[str, Any], ends: dict[int, int]) -> dict[str, Any]:
        """Effects once, offsets at the end, the outbox empty, every output record once; then tidy up."""
        rows = effects.check_rows(self.engine, config["table"], ends)
        problems = list(rows["problems"])
        if c.kstore:
            problems += effects.check_offsets(self.engine, self.settings, config["group"], config["topic"], ends)
        else:
            problems += checks.check_own_offsets(self.engine, config["table"], config["topic"], ends)
        if c.outbox_table and (left := checks.rows_left(self.engine, f"{config['table']}_outbox")):
            problems.append(f"{left} rows left in its outbox table")
        seen = workload.read_committed(self.bootstrap, config["out_topic"], self.opts.partitions)
        output = checks.check_output(seen, ends)
        problems += output["problems"]
        if problems:
            raise BenchmarkError(f"{c.name} ({config['phase']}) broke exactly-once:\n  " + "\n  ".join(problems)
                                 + f"\n(tables {config['table']}* kept for a look)")
        for table in (config["table"], f"{config['table']}_offsets", f"{config['table']}_outbox"):
            effects.drop_table(self.engine, table)
        detail = (f"{rows['rows']:,} effect rows and {output['records']:,} output records for "
                  f"{rows['expected']:,} messages, {output['duplicates']} duplicates, {output['missing']} missing")
        return {"passed": True, "effect_rows": rows["rows"], "output_records": output["records"],
                "duplicates": output["duplicates"], "missing": output["missing"], "detail": detail}

    def _noise(self) -> dict[str, float]:
        noise = self.noise.stop()
        if noise["other_cores"] > WARN_CORES:
            say(f"  WARNING: other processes used {noise['other_cores']:.2f} cores meanwhile: these numbers are "
                "disturbed")
        return noise

    def _say(self, phase: str, r: dict[str, Any]) -> None:
        if phase == "throughput":
            say(f"  drained {r['messages']:,}: {r['visible_msgs_per_s']:,.0f} msg/s until visible "
                f"({r['committed_msgs_per_s']:,.0f} msg/s until committed), CPU {r['cpu_s']:.1f} s; "
                f"{r['exactly_once']['detail']}")
        else:
            lat = r["latency"]
            behind = "" if lat["kept_up"] else " (FELL BEHIND)"
            say(f"  steady {r['rate']:,.0f} msg/s: commit-to-visible p50 {lat['p50_ms']:.1f} ms, "
                f"p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.1f} ms{behind}; {r['exactly_once']['detail']}")

    def cleanup(self, delete_topics: bool) -> None:
        """Forget this run's kstore offsets rows; delete its topics when the broker outlives the run."""
        try:
            effects.forget_groups(self.engine, self.settings, f"bench-{self.run_id}-%")
            if delete_topics and self.topics:
                side_by_side.delete_topics(self.bootstrap, self.topics)
        except Exception as exc:
            say(f"note: clean-up failed: {type(exc).__name__}: {exc}")
        finally:
            self.engine.dispose()
