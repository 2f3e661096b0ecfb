"""One benchmark run: prepare the topics and the database, then each contender in turn.

Per contender, two phases, each in a fresh child process with a fresh consumer
group and a fresh effects table:

* throughput: drain the pre-filled backlog topic;
* latency: a fresh empty topic; once the contender holds its partitions, the
  parent produces at a fixed rate and the contender reports each message's
  produce-to-done time.

After each phase the effects are checked exactly once, and the run stops with
an error at the first contender that fails.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from kstore import Settings, migrate

from . import avro, effects, workload
from .contenders import Contender
from .handsql import offsets_table
from .noise import WARN_CORES, Noise
from .profiling import summarize
from .spawn import BenchmarkError, Child, Outcome

READY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Options:
    messages: int = 1_000_000
    partitions: int = 12
    size: int = 100
    rate: float = 5000.0
    latency_seconds: float = 20.0
    latency_warmup: float | None = None
    txn_messages: int = 20_000
    out: Path = Path("benchmarks/results")
    only: str | None = None
    timeout: float = 3600.0
    #: None, "threads" (every thread, idle excluded) or "gil" (only the GIL's holder).
    profile: str | None = None
    broker_warmup: float = 60.0
    quiet_wait: float = 0.0
    retries: int = 0
    #: Latency phases per contender; the one with the median p99 is reported (see median_phase).
    latency_repeats: int = 1
    #: Throughput phases per contender; the one with the median msg/s is reported (see median_drain).
    drains: int = 1

    @property
    def warmup_s(self) -> float:
        """Leading seconds of the latency phase left out of the percentiles (connections, caches)."""
        if self.latency_warmup is not None:
            return self.latency_warmup
        return min(2.0, 0.2 * self.latency_seconds)


def latency_rate(requested: float, throughput: float) -> float:
    """The rate for a contender's latency phase.

    A contender that drains slower than twice the rate would only measure its
    own growing backlog, not latency: it gets half of what it drained instead
    (one transaction per message cannot take 5,000 messages/s).
    """
    return requested if throughput >= 2 * requested else max(1.0, float(round(throughput / 2)))


#: A contender kept up in the latency phase if it sustained this share of the offered rate.
KEPT_UP_SHARE = 0.95


def kept_up(messages: int, rate: float, span_s: float) -> bool:
    """Whether the contender handled the messages as fast as they came.

    One that falls behind ends well after the producer: its latencies then
    measure a backlog growing for the whole phase, not the cost of a message,
    and the table says so instead of printing them as latency.
    """
    return messages / max(span_s, 1e-9) >= KEPT_UP_SHARE * rate


def median_phase(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a contender's latency phases, the one with the median p99 (the lower of the two middle
    ones for an even count), with every phase's p50 and p99 beside it in run order. One 10- or
    20-second phase on a shared machine has moved a p99 by 2 to 5 times from run to run: the
    median of several is what a p99 target is judged on. Kept up only if every phase kept up."""
    if len(phases) == 1:
        return phases[0]
    chosen = _lower_median(phases, "p99_ms")
    chosen["p50_ms_each"] = [p["p50_ms"] for p in phases]
    chosen["p99_ms_each"] = [p["p99_ms"] for p in phases]
    chosen["kept_up"] = all(p.get("kept_up", True) for p in phases)
    return chosen


def median_drain(drains: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a contender's throughput phases, the one with the median msg/s (the lower of the two middle
    ones for an even count), with every phase's msg/s beside it in run order: on a shared 2-core
    machine one drain moves by 10% or more from run to run, and a target is judged on the median."""
    if len(drains) == 1:
        return drains[0]
    chosen = _lower_median(drains, "throughput_msgs_per_s")
    chosen["throughput_each"] = [d["throughput_msgs_per_s"] for d in drains]
    return chosen


def _lower_median(phases: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """A copy of the phase whose ``key`` is the median (the lower of the two middle ones for an even count)."""
    return dict(sorted(phases, key=lambda p: p[key])[(len(phases) - 1) // 2])


def libpq_params(dsn: str) -> dict[str, Any]:
    """psycopg2.connect() keywords for a SQLAlchemy DSN (the baseline does not load SQLAlchemy)."""
    url = make_url(dsn)
    params = {"host": url.host, "port": url.port, "user": url.username, "password": url.password,
              "dbname": url.database, **url.query}
    return {k: v for k, v in params.items() if v is not None}


class Runner:
    """Runs contenders against one broker and one database; see the module docstring."""

    def __init__(self, opts: Options, bootstrap: str, dsn: str, service_pids: list[int],
                 registry_url: str | None = None) -> None:
        self.opts = opts
        #: The schema registry of the Avro workload (None: no contender of this run needs one).
        self.registry_url = registry_url
        self.noise = Noise(service_pids)
        self.service_pids = service_pids
        self.bootstrap = bootstrap
        self.dsn = dsn
        self.run_id = uuid.uuid4().hex[:8]
        self.engine = sa.create_engine(dsn)
        #: kstore's settings as the kstore contenders see them (``KSTORE_*`` variables included).
        self.settings = Settings.from_env(dsn=dsn)
        self.logs = opts.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        #: ``{(workload, messages): (topic, end offsets)}``.
        self.backlogs: dict[tuple[str, int], tuple[str, dict[int, int]]] = {}
        self.topics: list[str] = []
        self.checkpoints = True

    # -- preparation ----------------------------------------------------------------

    def prepare(self, contenders: list[Contender]) -> None:
        """kstore's tables, and one pre-filled topic per workload and backlog size the contenders drain."""
        if any(c.workload == "avro" for c in contenders) and not self.registry_url:
            raise BenchmarkError("the Avro contenders need a schema registry (registry_url)")
        migrate(self.settings)
        backlogs = sorted({(c.workload, self.messages_for(c)) for c in contenders},
                          key=lambda b: (b[0] != "bytes", -b[1]))
        for kind, n in backlogs:
            self.backlogs[kind, n] = self._fill_backlog(kind, n)

    def messages_for(self, c: Contender) -> int:
        return self.opts.txn_messages if c.small else self.opts.messages

    def _fill_backlog(self, kind: str, n: int) -> tuple[str, dict[int, int]]:
        topic = self._new_topic(f"backlog-{n}" if kind == "bytes" else f"backlog-{kind}-{n}")
        started = time.monotonic()
        what = "messages" if kind == "bytes" else f"{kind} records"
        say(f"filling {topic} with {n:,} {what} of {self.opts.size} bytes on {self.opts.partitions} partitions")
        workload.prefill(self.bootstrap, topic, self.opts.partitions, n, self.opts.size,
                         self._values(kind, topic))
        ends = workload.end_offsets(self.bootstrap, topic, self.opts.partitions)
        if sum(ends.values()) != n:
            raise BenchmarkError(f"{topic} holds {sum(ends.values())} messages, expected {n}")
        say(f"filled in {time.monotonic() - started:.1f} s")
        return topic, ends

    def _new_topic(self, what: str) -> str:
        topic = f"bench-{self.run_id}-{what}"
        workload.create_topic(self.bootstrap, topic, self.opts.partitions)
        self.topics.append(topic)
        return topic

    def _values(self, kind: str, topic: str) -> workload.Values | None:
        """How ``topic``'s values are made: the bytes workload's own (None), or Avro records of the
        schema registered for the topic now."""
        if kind == "bytes":
            return None
        assert kind == "avro" and self.registry_url, kind
        return avro.AvroValues(avro.register(self.registry_url, topic), self.opts.size)

    # -- one contender --------------------------------------------------------------

    def run(self, c: Contender) -> dict[str, Any]:
        """Both phases of one contender; raises :class:`BenchmarkError` if either fails."""
        def drain(rep: str) -> dict[str, Any]:
            return self._least_disturbed(lambda suffix: self._throughput(c, f"{rep}{suffix}"))

        drained = median_drain([drain(f"-drain{i}" if i else "") for i in range(self.opts.drains)])
        if c.throughput_only:
            return {"number": c.number, "name": c.name, "label": c.label, "client": c.client, **drained,
                    "latency": None}
        rate = latency_rate(self.opts.rate, drained["throughput_msgs_per_s"])

        def phase(rep: str) -> dict[str, Any]:
            return self._least_disturbed(lambda suffix: self._latency(c, rate, suffix=f"{rep}{suffix}"))

        latency = median_phase([phase(f"-rep{i}" if i else "") for i in range(self.opts.latency_repeats)])
        return {"number": c.number, "name": c.name, "label": c.label, "client": c.client,
                **({"tuning": c.tuning} if c.tuning else {}), **drained, "latency": latency}

    def _least_disturbed(self, phase: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """Run a phase; while other processes disturbed it, again (``--retries``), keeping the calmest run.

        With ``--quiet-wait``, each attempt first waits for the machine to be quiet.
        Every attempt has its own group, table and names (the suffix).
        """
        best: dict[str, Any] | None = None
        for attempt in range(self.opts.retries + 1):
            if self.opts.quiet_wait > 0:
                self._wait_quiet()
            result = phase(f"-again{attempt}" if attempt else "")
            result["attempts"] = attempt + 1
            if best is None or result["noise"]["other_cores"] < best["noise"]["other_cores"]:
                best = result
            if result["noise"]["other_cores"] <= WARN_CORES:
                break
            if attempt < self.opts.retries:
                say(f"  disturbed: running this phase again ({attempt + 1} of {self.opts.retries} retries)")
        assert best is not None
        return best

    def _wait_quiet(self) -> None:
        waited = self.noise.wait_quiet(self.opts.quiet_wait)
        if waited > 3:
            say(f"  waited {waited:.0f} s for other processes to quieten down")

    def _config(self, c: Contender, phase: str, topic: str, messages: int, tag: str) -> dict[str, Any]:
        registry = self.registry_url if c.workload != "bytes" else None
        settings = c.kstore_settings if c.kstore else {}
        if c.kstore and registry:
            settings = {**settings, "schema_registry_url": registry}
        return {
            "contender": c.name, "entry": c.entry, "phase": phase,
            "bootstrap": self.bootstrap, "topic": topic, "partitions": self.opts.partitions,
            "group": f"bench-{self.run_id}-{tag}", "messages": messages,
            "table": table_name(self.run_id, tag) if c.writes_rows else None, "workload": c.workload,
            "dsn": with_driver(self.dsn, c.driver), "conninfo": libpq_params(self.dsn),
            "kstore_settings": settings, "tuning": c.tuning,
            "warmup_s": self.opts.warmup_s, "result_file": str(self.logs / f"{tag}.json"),
            "parent_pid": os.getpid(), "service_pids": self.service_pids,
            **({"schema_registry_url": registry} if registry else {}),
        }

    def drain(self, c: Contender, suffix: str = "") -> dict[str, Any]:
        """The throughput phase alone (``benchmarks.sweep``): drain the backlog, checked exactly once;
        with ``--quiet-wait``, once the machine is quiet."""
        if self.opts.quiet_wait > 0:
            self._wait_quiet()
        return self._throughput(c, suffix)

    def _throughput(self, c: Contender, suffix: str = "") -> dict[str, Any]:
        messages = self.messages_for(c)
        topic, ends = self.backlogs[c.workload, messages]
        tag = f"{c.number}-{c.name}-throughput{suffix}"
        config = self._config(c, "throughput", topic, messages, tag)
        self._fresh_state(config)
        profile = self.opts.out / f"profile-{c.number}-{c.name}.txt" if self.opts.profile else None
        self.noise.start()
        child = Child(config, self.logs / f"{tag}.log", profile, gil=self.opts.profile == "gil")
        try:
            outcome = child.wait(self.opts.timeout)
        finally:
            child.kill()
        noise = self._noise()
        check = self._check(c, config, ends)
        if profile is not None:
            profile.with_suffix(".top.txt").write_text(summarize(profile, gil=self.opts.profile == "gil") + "\n")
        r = outcome.result
        say(f"  drained {messages:,} in {r['seconds']:.1f} s: {r['throughput']:,.0f} msg/s, "
            f"peak RSS {outcome.peak_rss_mb:.0f} MB, CPU {outcome.cpu_s:.1f} s; {check['detail']}")
        return {
            "messages": messages, "seconds": r["seconds"], "throughput_msgs_per_s": r["throughput"],
            "peak_rss_mb": outcome.peak_rss_mb, "rss_mb_by_tenth": r["rss_mb_by_tenth"], "cpu_s": outcome.cpu_s,
            **({"run_cpu_s": r["run_cpu_s"]} if "run_cpu_s" in r else {}),
            "exactly_once": check, "noise": noise,
            **({"kstore_settings": r["kstore_settings"]} if "kstore_settings" in r else {}),
            **({"main_thread": r["main_thread"]} if "main_thread" in r else {}),
        }

    def warm_up(self, c: Contender) -> None:
        """A short latency phase whose numbers are dropped: the first contender would otherwise
        pay for a cold broker (JIT compilation, the group coordinator's first group)."""
        seconds = self.opts.broker_warmup
        say(f"warming up the broker: {seconds:.0f} s of {c.name} at {self.opts.rate:,.0f} msg/s (not reported)")
        self._latency(c, self.opts.rate, seconds, "warmup")

    def _latency(
        self, c: Contender, rate: float, seconds: float | None = None, name: str = "latency", suffix: str = ""
    ) -> dict[str, Any]:
        messages = max(1, round(rate * (seconds or self.opts.latency_seconds)))
        topic = self._new_topic(f"{name}-{c.number}{suffix}")
        tag = f"{c.number}-{c.name}-{name}{suffix}"
        config = self._config(c, "latency", topic, messages, tag)
        config["ready_file"] = str(self.logs / f"{tag}.ready")
        values = self._values(c.workload, topic)
        Path(config["ready_file"]).unlink(missing_ok=True)
        self._fresh_state(config)
        profile = self.opts.out / f"profile-{tag}.txt" if self.opts.profile and name == "latency" else None
        child = Child(config, self.logs / f"{tag}.log", profile, gil=self.opts.profile == "gil")
        try:
            child.wait_ready(Path(config["ready_file"]), READY_TIMEOUT_S)
            self.noise.start()
            took = workload.produce_at_rate(self.bootstrap, topic, self.opts.partitions, messages,
                                            self.opts.size, rate, values)
            outcome: Outcome = child.wait(took + 120)
        finally:
            child.kill()
        noise = self._noise()
        ends = workload.end_offsets(self.bootstrap, topic, self.opts.partitions)
        check = self._check(c, config, ends)
        if profile is not None:
            profile.with_suffix(".top.txt").write_text(summarize(profile, gil=self.opts.profile == "gil") + "\n")
        lat = outcome.result["latency"]
        lat["kept_up"] = kept_up(messages, rate, lat["span_s"])
        behind = "" if lat["kept_up"] else f" (FELL BEHIND: sustained only {messages / lat['span_s']:,.0f} msg/s)"
        say(f"  latency at {rate:,.0f} msg/s for {took:.1f} s: p50 {lat['p50_ms']:.1f} ms, "
            f"p99 {lat['p99_ms']:.1f} ms{behind}; {check['detail']}")
        return {"rate": rate, "seconds": took, "messages": messages, **lat,
                "peak_rss_mb": outcome.peak_rss_mb, "exactly_once": check, "noise": noise}

    def _noise(self) -> dict[str, float]:
        noise = self.noise.stop()
        if noise["other_cores"] > WARN_CORES:
            say(f"  WARNING: other processes used {noise['other_cores']:.2f} cores meanwhile "
                f"({noise['other_cpu_s']:.1f} CPU s): these numbers are disturbed")
        return noise

    def _fresh_state(self, config: dict[str, Any]) -> None:
        """An empty effects table, and the database's dirty pages of earlier runs flushed."""
        if config["table"]:
            effects.drop_table(self.engine, config["table"])
            if config["workload"] == "avro":
                effects.create_table(self.engine, config["table"], avro.COLUMNS_SQL)
            else:
                effects.create_table(self.engine, config["table"])
        if self.checkpoints and not effects.checkpoint(self.engine):
            self.checkpoints = False
            say("note: CHECKPOINT was refused (not a superuser): earlier runs' writes may slow later ones")

    def _check(self, c: Contender, config: dict[str, Any], ends: dict[int, int]) -> dict[str, Any]:
        """Every message's effect exactly once (and kstore's offsets at the end); the table is then dropped."""
        problems: list[str] = []
        details: list[str] = []
        if c.writes_rows:
            rows = effects.check_rows(self.engine, config["table"], ends)
            problems += rows["problems"]
            details.append(f"exactly once: {rows['rows']:,} rows, {rows['distinct']:,} distinct offsets, "
                           f"{rows['expected']:,} messages")
        if c.kstore:
            problems += effects.check_offsets(self.engine, self.settings, config["group"], config["topic"], ends)
            details.append("stored offsets at the end of every partition")
        if c.own_offsets:
            problems += effects.check_own_offsets(self.engine, offsets_table(config), config["group"],
                                                  config["topic"], ends)
            details.append("its own stored offsets at the end of every partition")
        if not details:
            details.append(f"all {sum(ends.values()):,} messages received (reads only: no effects to check)")
        if problems:
            kept = f"\n(effects kept in table {config['table']} for a look)" if c.writes_rows else ""
            raise BenchmarkError(
                f"{c.name} ({config['phase']}) broke exactly-once:\n  " + "\n  ".join(problems) + kept
            )
        if c.writes_rows:
            effects.drop_table(self.engine, config["table"])
        if c.own_offsets:
            effects.drop_table(self.engine, offsets_table(config))
        return {"passed": True, "detail": "; ".join(details)}

    # -- the end --------------------------------------------------------------------

    def cleanup(self, delete_topics: bool) -> None:
        """Forget this run's offsets rows; delete its topics when the broker outlives the run.

        Best effort: a failure here is reported, never allowed to hide the run's own result.
        """
        try:
            effects.forget_groups(self.engine, self.settings, f"bench-{self.run_id}-%")
            if delete_topics and self.topics:
                workload.delete_topics(self.bootstrap, self.topics)
        except Exception as exc:
            say(f"note: clean-up failed: {type(exc).__name__}: {exc}")
        finally:
            self.engine.dispose()

    def server_version(self) -> str:
        return effects.server_version(self.engine)


#: PostgreSQL cuts longer identifiers to this many bytes.
MAX_IDENTIFIER = 63


def table_name(run_id: str, tag: str) -> str:
    """The effects table of one phase, readable but short enough that its ``_offsets`` sibling
    (the hand-written loops' own offsets table) is not cut to the same name by PostgreSQL."""
    name = f"bench_{run_id}_{tag.replace('-', '_')}"
    room = MAX_IDENTIFIER - len("_offsets")
    if len(name) <= room:
        return name
    return f"{name[:room - 9]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def with_driver(dsn: str, driver: str | None) -> str:
    """``dsn`` with its SQLAlchemy driver replaced (``postgresql+psycopg``), or as it is."""
    if driver is None:
        return dsn
    url = make_url(dsn)
    return url.set(drivername=f"{url.get_backend_name()}+{driver}").render_as_string(hide_password=False)


def say(message: str) -> None:
    print(f"bench: {message}", flush=True)
