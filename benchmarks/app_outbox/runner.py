"""One application outbox benchmark run: the relay, then each phase of each contender, side by side.

Per contender and phase, a fresh orders table and output topic. The reader (:mod:`.reader`) is
started, and connected, before the requests; the relay (one ``kstore relay --outbox bench-app``
for the whole run) holds every shard, its producers initialised, before the first phase. Phases:

* **flat out**: ``--requests`` requests as fast as the threads go;
* **paced**: ``--rate`` requests/s for ``--seconds`` (no request starts later: a contender that fell
  behind makes fewer), the first ``--warmup`` seconds left out of the percentiles; one phase per rate.

Throughput is the records read over the time from the first request's start until the reader saw
the last one; commit-to-readable latency is :mod:`.records`'. Beside them, per phase: the commit as
the request saw it (kstore's outbox write, its shard-lock wait and hold, the COMMIT itself), what the
requests' database sessions waited for (:class:`WaitSampler`), and the relay's CPU and Kafka
transactions (its /metrics). After each phase the orders table and the whole topic (a full
``read_committed`` read) are compared: kstore must show every committed order's record exactly once
(else the run stops with an error); for the by-hand loop the records it lost or duplicated are
counted and reported.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kstore import Settings, migrate
from kstore.outbox import Outbox
from kstore.relay.lanes import lanes_of
from kstore.relay.store import Outbox as OutboxTables

from .. import workload as side_by_side
from ..meter import latency_stats
from ..noise import WARN_CORES, Noise
from ..outbox.workload import read_committed
from ..runner import kept_up, say
from ..spawn import REPO, BenchmarkError, Child
from .app import APPLICATION_NAME, OUTBOX, SHARDS, orders_table
from .records import load, order_event

READY_TIMEOUT_S = 90.0
#: How long the relay may take to hold its shards (each a transactional producer to initialise).
RELAY_READY_S = 120.0
#: After the requests, how long the outbox may take to be marked published (kstore).
DRAIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    #: ``module:function`` run in the child process (``benchmarks.child``): ``function(config, meter)``.
    entry: str
    kstore: bool = False


CONTENDERS: tuple[Contender, ...] = (
    Contender("kstore-app-outbox", "kstore Outbox.produce() + kstore relay", "benchmarks.app_outbox.app:kstore_app",
              kstore=True),
    Contender("publish-after-commit", "by hand: COMMIT, then Producer.produce()",
              "benchmarks.app_outbox.app:publish_after_commit"),
)


@dataclass(frozen=True)
class Options:
    requests: int = 20_000
    rates: tuple[float, ...] = (2000.0, 5000.0)
    seconds: float = 20.0
    warmup: float = 2.0
    threads: int = 50
    partitions: int = 8
    broker_warmup: float = 5.0
    out: Path = Path("benchmarks/results/app_outbox.json")
    timeout: float = 1800.0
    reader_idle_s: float = 30.0
    relay_log_level: str = "INFO"
    switch_interval: float | None = None
    shards: int = SHARDS

    @property
    def logs(self) -> Path:
        return self.out.parent / "logs" / self.out.stem


class Relay:
    """``kstore relay --outbox bench-app``, a subprocess logging to a file, serving /metrics on a
    local port (read per phase: its transactions, records and publish latency)."""

    def __init__(self, dsn: str, bootstrap: str, log_path: Path, log_level: str) -> None:
        self.log_path = log_path
        self.port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kstore", "--log-level", log_level, "relay", "--outbox", OUTBOX, "--dsn", dsn,
                 "--bootstrap-servers", bootstrap, "--metrics-port", str(self.port), "--metrics-host", "127.0.0.1"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    def wait_ready(self, shards: int, timeout: float) -> None:
        """Until it holds every lane (their producers start with the first records: the broker warm-up's)."""
        pattern = re.compile(rf"outbox relay \S+ publishes (?:shard|lane) \d+[^']* of group '{OUTBOX}'")
        deadline = time.monotonic() + timeout
        while len(pattern.findall(self.log())) < lanes_of(shards):
            if self.proc.poll() is not None:
                raise BenchmarkError(f"the relay exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise BenchmarkError(f"the relay did not hold its {shards} shards within {timeout:.0f} s:\n"
                                     f"{self.tail()}")
            time.sleep(0.1)

    def sample(self) -> dict[str, float]:
        """Its CPU seconds so far and its counters (from /metrics)."""
        if self.proc.poll() is not None:
            raise BenchmarkError(f"the relay exited ({self.proc.returncode}):\n{self.tail()}")
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        out = {"cpu_s": (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")}
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as page:
            text = page.read().decode()
        for name, key in (("kstore_outbox_published_total", "records"),
                          ("kstore_outbox_publish_latency_seconds_count", "transactions"),
                          ("kstore_outbox_publish_latency_seconds_sum", "latency_sum_s")):
            found = re.search(rf"^{name}\{{[^}}]*group=\"{OUTBOX}\"[^}}]*\}} (\S+)$", text, re.M)
            out[key] = float(found.group(1)) if found else 0.0
        return out

    def stop(self) -> int | None:
        """SIGTERM (it finishes its transactions and releases its shards), then wait."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) + f"\n(full log: {self.log_path})"


class WaitSampler:
    """What the requests' database sessions are doing, sampled from ``pg_stat_activity`` every
    :attr:`INTERVAL_S` on a thread of the parent: the share of sessions (over all samples) per
    state and wait event. ``active, Lock:object`` is a COMMIT waiting for the database-wide lock
    PostgreSQL takes to queue a NOTIFY; ``Lock:transactionid``/``Lock:tuple`` a row lock (kstore's
    shard rows); ``IO:WALSync``/``LWLock:WALWrite`` the WAL flush of a COMMIT; ``idle in transaction``
    the application's own work between statements; ``idle`` between requests."""

    INTERVAL_S = 0.02
    QUERY = sa.text("SELECT state, wait_event_type, wait_event FROM pg_stat_activity "
                    "WHERE application_name = :name AND backend_type = 'client backend'")

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wait-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            while not self._stop.wait(self.INTERVAL_S):
                rows = conn.execute(self.QUERY, {"name": APPLICATION_NAME}).all()
                if rows:
                    self.samples += 1
                for state, kind, what in rows:
                    self.counts[f"{state}, {kind}:{what}" if kind else str(state)] += 1

    def stop(self) -> dict[str, float]:
        """The shares (sessions sampled in each state, over all sessions sampled), largest first."""
        self._stop.set()
        self._thread.join(10)
        total = sum(self.counts.values()) or 1
        return {k: round(n / total, 3) for k, n in self.counts.most_common(8)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def relay_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The relay's share of one phase: its CPU, Kafka transactions, records per transaction, and the
    mean age of each transaction's oldest record at its Kafka commit (written in the request's
    commit -> published)."""
    d = {k: after[k] - before[k] for k in after}
    txns = d["transactions"]
    return {"cpu_s": round(d["cpu_s"], 2), "transactions": int(txns), "records": int(d["records"]),
            "records_per_transaction": round(d["records"] / txns, 1) if txns else None,
            "oldest_record_age_at_kafka_commit_ms": round(d["latency_sum_s"] / txns * 1000, 1) if txns else None}


def _pair(p: dict[str, float]) -> str:
    return f"{p['p50_ms']:g}/{p['p99_ms']:g}"


def percentiles(values: list[int]) -> dict[str, float]:
    """p50/p90/p99/max of nanosecond durations, in ms (nearest rank)."""
    if not values:
        return {}
    s = sorted(values)

    def pct(q: float) -> float:
        return round(s[max(0, math.ceil(q * len(s)) - 1)] / 1e6, 2)

    return {"p50_ms": pct(0.5), "p90_ms": pct(0.9), "p99_ms": pct(0.99), "max_ms": round(s[-1] / 1e6, 2)}


class AppRunner:
    """Runs the contenders against one broker and one database; see the module docstring."""

    def __init__(self, opts: Options, bootstrap: str, dsn: str, service_pids: list[int]) -> None:
        self.opts = opts
        self.bootstrap = bootstrap
        self.dsn = dsn
        self.noise = Noise(service_pids)
        self.run_id = uuid.uuid4().hex[:8]
        self.engine = sa.create_engine(dsn)
        self.settings = Settings.from_env(dsn=dsn)
        self.logs = opts.logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.topics: list[str] = []
        self.relay: Relay | None = None
        self.outbox = OutboxTables(self.engine, OUTBOX, self.settings.table_prefix, self.settings.schema)
        self._phases = 0

    def prepare(self) -> None:
        """kstore's tables, the outbox's shards (before the relay: it would make its own count), the relay."""
        migrate(self.settings)
        wanted = self.opts.shards
        shards = Outbox(OUTBOX, self.settings, shards=wanted).setup(self.engine)
        if shards != wanted:
            raise BenchmarkError(f"outbox {OUTBOX!r} has {shards} shards in this database, the benchmark wants "
                                 f"{wanted}: use a fresh database (or delete its rows of kstore's outbox tables)")
        say(f"starting kstore relay --outbox {OUTBOX} (log level {self.opts.relay_log_level})")
        self.relay = Relay(self.dsn, self.bootstrap, self.logs / f"{self.run_id}-relay.log", self.opts.relay_log_level)
        self.relay.wait_ready(wanted, RELAY_READY_S)
        self._drain()  # whatever an earlier run left
        say(f"the relay holds the {wanted} shards")

    def phase(self, c: Contender, name: str, rate: float | None, seconds: float | None = None) -> dict[str, Any]:
        """One phase of one contender (flat out when ``rate`` is None), checked."""
        self._phases += 1
        tag = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{name}-{c.name}")  # a topic's name: no "/"
        n = self.opts.requests if rate is None else max(1, round(rate * (seconds or self.opts.seconds)))
        table = f"bench_app_{self.run_id}_{self._phases}"
        orders = orders_table(table)
        orders.drop(self.engine, checkfirst=True)
        orders.create(self.engine)
        topic = f"bench-{self.run_id}-app-{tag}"
        side_by_side.create_topic(self.bootstrap, topic, self.opts.partitions)
        self.topics.append(topic)
        seconds = None if rate is None else (seconds or self.opts.seconds)
        config = self._config(c, tag, n, rate, seconds, table, topic)
        reader = Child(self._reader_config(config, tag), self.logs / f"{self.run_id}-{tag}-reader.log")
        child: Child | None = None
        relay_before = self.relay.sample() if self.relay else None
        try:
            reader.wait_ready(Path(self.logs / f"{self.run_id}-{tag}-reader.ready"), READY_TIMEOUT_S)
            self.noise.start()
            child = Child(config, self.logs / f"{self.run_id}-{tag}.log")
            sampler = WaitSampler(self.engine)
            try:
                outcome = child.wait(self.opts.timeout)
            finally:
                waits = sampler.stop()
            committed = len(load(config["stamps_file"])["ids"])
            done_file = Path(config["done_file"])
            done_file.with_name(done_file.name + ".tmp").write_text(str(committed))
            done_file.with_name(done_file.name + ".tmp").replace(done_file)  # read whole or not at all
            reader.wait(self.opts.timeout)
        finally:
            reader.kill()
            if child is not None:
                child.kill()
        if c.kstore:
            self._drain()
        noise = self._noise()
        result = self._measure(c, config, outcome.result)
        result.update(cpu_s=round(outcome.cpu_s, 2), peak_rss_mb=round(outcome.peak_rss_mb), noise=noise,
                      db_sessions=waits)
        if relay_before is not None and self.relay is not None:
            relay = relay_delta(relay_before, self.relay.sample())
            if c.kstore:
                result["relay"] = relay
            else:  # the relay idles meanwhile (its share of the machine when it has nothing to publish)
                result["relay_idle_cpu_s"] = relay["cpu_s"]
        for key in ("flush_s", "not_delivered", "delivery_errors"):
            if key in outcome.result:
                result[key] = outcome.result[key]
        result["exactly_once"] = self._check(c, table, topic, committed)
        orders.drop(self.engine)
        self._say(c, name, result)
        return result

    def _config(self, c: Contender, tag: str, n: int, rate: float | None, seconds: float | None, table: str,
                topic: str) -> dict[str, Any]:
        base = self.logs / f"{self.run_id}-{tag}"
        return {
            "contender": c.name, "entry": c.entry, "phase": tag, "bootstrap": self.bootstrap, "dsn": self.dsn,
            "out_topic": topic, "partitions": self.opts.partitions, "group": f"bench-{self.run_id}-{tag}",
            "messages": n, "rate": rate, "seconds": seconds, "threads": self.opts.threads, "table": table,
            "switch_interval": self.opts.switch_interval, "shards": self.opts.shards,
            "stamps_file": f"{base}.stamps.json", "result_file": f"{base}.json", "done_file": f"{base}.done",
        }

    def _reader_config(self, config: dict[str, Any], tag: str) -> dict[str, Any]:
        base = self.logs / f"{self.run_id}-{tag}-reader"
        for leftover in (Path(f"{base}.ready"), Path(config["done_file"])):
            leftover.unlink(missing_ok=True)
        return {
            "contender": "reader", "entry": "benchmarks.app_outbox.reader:run", "phase": "read",
            "bootstrap": self.bootstrap, "topic": config["out_topic"], "partitions": self.opts.partitions,
            "group": config["group"], "messages": config["messages"], "ready_file": f"{base}.ready",
            "done_file": config["done_file"], "idle_s": self.opts.reader_idle_s,
            "stamps_file": f"{base}.stamps.json", "result_file": f"{base}.json",
        }

    def _drain(self) -> None:
        """Until the relay marked everything published (the next phase starts with an empty outbox)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while (left := self.outbox.backlog()[0]) > 0:
            if time.monotonic() > deadline:
                raise BenchmarkError(f"the outbox still holds {left} rows {DRAIN_TIMEOUT_S:.0f} s after the requests")
            time.sleep(0.1)

    def _measure(self, c: Contender, config: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
        """Throughput until readable and commit-to-readable latency, from the two stamp files."""
        mine = load(config["stamps_file"])
        theirs = load(config["stamps_file"].replace(".stamps", "-reader.stamps"))
        committed = dict(zip(mine["ids"], mine["commit"], strict=True))
        readable = dict(zip(theirs["ids"], theirs["t"], strict=True))
        if unknown := set(readable) - set(committed):
            raise BenchmarkError(f"{c.name}: {len(unknown)} records read whose requests never committed")
        n, rate = int(config["messages"]), config["rate"]
        first = mine["first_ns"]
        seconds = (theirs["last_ns"] - first) / 1e9 if theirs["last_ns"] else float("nan")
        warmup_ns = int(self.opts.warmup * 1e9) if rate else 0
        cutoff = min(mine["commit"]) + warmup_ns
        kept = [k for k, t in enumerate(mine["commit"]) if t >= cutoff]
        out: dict[str, Any] = {
            "requests": n, "committed": len(committed), "rate": rate, "seconds": round(seconds, 3),
            "readable": len(readable), "readable_per_s": len(readable) / seconds,
            "committed_per_s": child["throughput"], "reader_repeats": theirs["repeated"],
            # From the request's start to its COMMIT returning.
            "request_ms": percentiles([mine["commit"][k] - mine["begin"][k] for k in kept]),
            # The session's commit as the application sees it: for kstore, its outbox write (before_commit:
            # the shard locks, of which the statement that takes them, its rows, the NOTIFY), then
            # the COMMIT statement itself.
            "commit_ms": percentiles([mine["commit"][k] - mine["body"][k] for k in kept]),
            "outbox_write_ms": percentiles([max(0, mine["sql_end"][k] - mine["body"][k]) for k in kept]),
            "shard_lock_ms": percentiles([mine["lock"][k] for k in kept]),
            # From holding the shard locks to the COMMIT returning: how long a request keeps the others of
            # its shard waiting (the shard's commits/s are at most 1 / this).
            "shard_lock_held_ms": percentiles([mine["commit"][k] - mine["locked_at"][k] for k in kept
                                               if mine["locked_at"][k]]),
            "commit_statement_ms": percentiles([mine["commit"][k] - max(mine["sql_end"][k], mine["body"][k])
                                                for k in kept]),
        }
        if rate:  # how late requests started against their schedule
            out["start_lag_ms"] = percentiles([max(0, mine["begin"][k] - first - int(mine["ids"][k] / rate * 1e9))
                                               for k in kept])
        ids = list(readable)
        lat = latency_stats([committed[o] for o in ids], [readable[o] for o in ids], warmup_ns)
        # Paced: kept up if it committed (and the reader saw) about the rate's worth of requests in time.
        lat["kept_up"] = kept_up(len(readable), rate, lat["span_s"]) if rate else True
        out["latency"] = lat
        return out

    def _check(self, c: Contender, table: str, topic: str, n: int) -> dict[str, Any]:
        """Every committed order's record once in the topic (a full read_committed read), keyed by its customer."""
        with self.engine.connect() as conn:
            placed = {int(i): str(cust) for i, cust in conn.execute(sa.text(f"SELECT id, customer FROM {table}"))}
        if len(placed) != n:
            raise BenchmarkError(f"{c.name}: {len(placed)} orders in the table, {n} requests committed")
        seen = read_committed(self.bootstrap, topic, self.opts.partitions)
        per_order: Counter[int] = Counter()
        wrong: list[str] = []
        for (key, value), count in seen.items():
            event = json.loads(value)
            order = int(event["order"])
            per_order[order] += count
            if order in placed and (event != order_event(order) or key != placed[order].encode()):
                wrong.append(f"order {order}: key {key!r}, value {value!r}")
        missing = set(placed) - set(per_order)
        stray = set(per_order) - set(placed)
        duplicates = sum(k - 1 for k in per_order.values() if k > 1)
        problems = [f"{len(wrong)} records unlike their order, e.g. {wrong[:3]}"] if wrong else []
        if stray:
            problems.append(f"{len(stray)} records of orders never committed, e.g. {sorted(stray)[:5]}")
        lost_or_twice = []
        if missing:
            lost_or_twice.append(f"{len(missing):,} committed orders have no record, e.g. {sorted(missing)[:5]}")
        if duplicates:
            lost_or_twice.append(f"{duplicates:,} records more than once")
        if c.kstore:
            problems += lost_or_twice
        elif lost_or_twice:
            say(f"  {c.name} (at most once) " + "; ".join(lost_or_twice))
        if problems:
            raise BenchmarkError(f"{c.name} broke exactly-once:\n  " + "\n  ".join(problems)
                                 + f"\n(table {table} kept for a look)")
        return {"passed": not lost_or_twice, "orders": len(placed), "records": sum(seen.values()),
                "lost": len(missing), "duplicates": duplicates,
                "guarantee": "exactly once" if c.kstore else "at most once"}

    def _noise(self) -> dict[str, float]:
        noise = self.noise.stop()
        if noise["other_cores"] > WARN_CORES:
            say(f"  WARNING: other processes used {noise['other_cores']:.2f} cores meanwhile: these numbers are "
                "disturbed")
        return noise

    def _say(self, c: Contender, name: str, r: dict[str, Any]) -> None:
        lat, once = r["latency"], r["exactly_once"]
        behind = "" if lat["kept_up"] else " (FELL BEHIND)"
        relay = ""
        held = f"; shard locks held {_pair(r['shard_lock_held_ms'])} ms" if r["shard_lock_held_ms"] else ""
        if "relay" in r:
            rl = r["relay"]
            relay = (f"; relay {rl['transactions']:,} txns of {rl['records_per_transaction']} records, "
                     f"oldest {rl['oldest_record_age_at_kafka_commit_ms']} ms at Kafka commit, CPU {rl['cpu_s']} s")
        say(f"  {name} {c.name}: {r['readable_per_s']:,.0f} req/s readable ({r['committed_per_s']:,.0f} committed), "
            f"commit-to-readable p50 {lat['p50_ms']:.1f} p99 {lat['p99_ms']:.1f} max {lat['max_ms']:.1f} ms{behind}; "
            f"commit p50/p99 {_pair(r['commit_ms'])} ms (outbox write {_pair(r['outbox_write_ms'])}, shard lock "
            f"{_pair(r['shard_lock_ms'])}, COMMIT {_pair(r['commit_statement_ms'])}){held}{relay}; "
            f"db sessions {', '.join(f'{k} {v:.0%}' for k, v in list(r['db_sessions'].items())[:3])}; "
            f"{once['records']:,} records for {once['orders']:,} orders, {once['lost']} lost, "
            f"{once['duplicates']} duplicated")

    def cleanup(self, delete_topics: bool) -> None:
        """Stop the relay; delete the run's topics when the broker outlives the run."""
        try:
            if self.relay is not None:
                code = self.relay.stop()
                if code not in (0, None):
                    say(f"note: the relay exited {code}: {self.relay.log_path}")
            if delete_topics and self.topics:
                side_by_side.delete_topics(self.bootstrap, self.topics)
        except Exception as exc:
            say(f"note: clean-up failed: {type(exc).__name__}: {exc}")
        finally:
            self.engine.dispose()
