"""How long a group stops committing when its workers restart or crash, per client and protocol.

``python -m benchmarks.rebalance``: a topic of 12 partitions gets messages at a steady rate
while 3 ``kstore worker`` processes consume it; then either each worker in turn is stopped with
SIGTERM and started again (``rolling``), or one is killed with SIGKILL and not started again
(``kill``). A monitor reads kstore's offsets table every 50 ms; a partition's **stall** is the
longest time between two commits of it (a change of its stored offset) from the moment the
group is settled until the producer stops. Reported per run: the longest stall of any partition,
and the longest between two commits by the same worker (a partition that did not move, which an
eager rebalance stops too, and an incremental one need not). Every run is checked exactly once (every
offset of every partition has one effects row, and the stored offsets stand at the log ends).

Services: a local Kafka broker and PostgreSQL, as ``python -m benchmarks`` starts them
(or ``--bootstrap-servers``/``--dsn``). The broker keeps its defaults, so a group on the consumer
protocol (KIP-848) has the broker's 45 s session timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer

from kstore import Message, Processor, Settings, migrate

from .effects import check_offsets, check_rows, create_table, drop_table
from .services import local_kafka, local_postgres
from .spawn import REPO, BenchmarkError
from .workload import create_topic

PARTITIONS = 12
WORKERS = 3
#: The settings docs/operations.md recommends for a shorter session.
SHORT_SESSION = {"KSTORE_SESSION_TIMEOUT_MS": "6000", "KSTORE_HEARTBEAT_INTERVAL_MS": "2000",
                 "KSTORE_IDLE_IN_TRANSACTION_TIMEOUT_MS": "6000"}


@dataclass(frozen=True)
class Config:
    name: str
    client: str
    protocol: str
    env: dict[str, str] = field(default_factory=dict)


CONFIGS = (
    Config("kafka-python eager", "kafka-python", "eager"),
    Config("kafka-python eager, 6 s session", "kafka-python", "eager", SHORT_SESSION),
    Config("confluent eager", "confluent", "eager"),
    Config("confluent cooperative", "confluent", "cooperative"),
    Config("confluent cooperative, 6 s session", "confluent", "cooperative", SHORT_SESSION),
    Config("confluent consumer (KIP-848)", "confluent", "consumer"),
)
SCENARIOS = ("rolling", "kill")


class Sink(Processor):
    """One row per message in the table ``REBALANCE_BENCH_TABLE`` (no key: a duplicate shows)."""

    group = "rebalance-bench"

    def setup(self) -> None:
        table = os.environ["REBALANCE_BENCH_TABLE"]
        self.insert = sa.text(f"INSERT INTO {table} (partition_id, kafka_offset) VALUES (:p, :o)")

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.session.execute(self.insert, [{"p": m.partition, "o": m.offset} for m in msgs])


class SteadyProducer:
    """``rate`` messages a second, round-robin over the partitions, until stopped; counts deliveries."""

    def __init__(self, bootstrap: str, topic: str, rate: float) -> None:
        self.delivered = [0] * PARTITIONS
        self.failed = 0
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(topic, rate), daemon=True)
        self._thread.start()

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is None:
            self.delivered[msg.partition()] += 1
        else:
            self.failed += 1

    def _run(self, topic: str, rate: float) -> None:
        started, sent = time.monotonic(), 0
        while not self._stop.is_set():
            due = int((time.monotonic() - started) * rate)
            for _ in range(due - sent):
                self._producer.produce(topic, b"x" * 100, partition=sent % PARTITIONS, on_delivery=self._delivered)
                sent += 1
            self._producer.poll(0)
            time.sleep(0.01)
        self._producer.flush(30)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(60)
        if self.failed:
            raise BenchmarkError(f"{self.failed} messages were not delivered")
        return dict(enumerate(self.delivered))


class Monitor:
    """Reads the group's stored offsets every 50 ms: when each partition last moved, and its owners."""

    def __init__(self, engine: sa.Engine, group: str) -> None:
        self._engine = engine
        self._group = group
        #: Per partition: when its stored offset was seen to move, and the row's owner then.
        self.moves: dict[int, list[tuple[float, str]]] = {p: [] for p in range(PARTITIONS)}
        self._last: dict[int, int | None] = {}
        self._recording = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        query = sa.text("SELECT partition_id, next_offset, owner FROM kstore_offsets WHERE consumer_group = :g")
        with self._engine.connect() as conn:
            while not self._stop.is_set():
                now = time.monotonic()
                rows = conn.execute(query, {"g": self._group}).all()
                conn.rollback()
                for p, offset, owner in rows:
                    if self._last.get(p) != offset:
                        self._last[p] = offset
                        if self._recording:
                            self.moves[p].append((now, owner))
                time.sleep(0.05)

    def settled(self) -> bool:
        """Every partition has a stored offset."""
        return len(self._last) == PARTITIONS and all(v is not None for v in self._last.values())

    def record(self) -> float:
        self._recording = True
        return time.monotonic()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(10)
        return time.monotonic()

    def stalls(self, start: float, end: float) -> tuple[dict[int, float], dict[int, float]]:
        """Per partition: the longest time between two of its commits in [start, end]; and the
        longest between two commits by the same owner (a stall of a partition that did not move)."""
        longest, kept = {}, {}
        for p, moves in self.moves.items():
            points = [(start, None), *moves, (end, None)]
            longest[p] = max(b - a for (a, _), (b, _) in itertools.pairwise(points))
            kept[p] = max((b - a for (a, x), (b, y) in itertools.pairwise(moves) if x == y), default=0.0)
        return longest, kept


class Workers:
    """``kstore worker benchmarks.rebalance:Sink`` processes, each with its own log."""

    def __init__(self, config: Config, dsn: str, bootstrap: str, topic: str, group: str, table: str,
                 logs: Path) -> None:
        self.config, self.logs = config, logs
        self.args = ["worker", "benchmarks.rebalance:Sink", "--dsn", dsn, "--bootstrap-servers", bootstrap,
                     "--topic", topic, "--group", group, "--kafka-client", config.client,
                     "--rebalance-protocol", config.protocol]
        self.env = {**os.environ, **config.env, "REBALANCE_BENCH_TABLE": table,
                    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self) -> int:
        log = self.logs / f"worker-{len(self.procs) + 1}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kstore", *self.args], cwd=REPO, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((proc, log))
        return len(self.procs) - 1

    def wait_claimed(self, index: int, timeout: float = 120) -> None:
        proc, log = self.procs[index]
        deadline = time.monotonic() + timeout
        while "kstore.engine.worker: claimed " not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchmarkError(f"worker {index + 1} claimed nothing (exit {proc.poll()}): see {log}")
            time.sleep(0.1)

    def terminate(self, index: int, timeout: float = 90) -> None:
        proc, log = self.procs[index]
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise BenchmarkError(f"worker {index + 1} did not stop on SIGTERM within {timeout:.0f} s: "
                                 f"see {log}") from None
        if code != 0:
            raise BenchmarkError(f"worker {index + 1} exited {code} on SIGTERM: see {log}")

    def kill(self, index: int) -> None:
        proc, _log = self.procs[index]
        proc.kill()
        proc.wait(30)

    def stop_all(self) -> None:
        for index, (proc, _log) in enumerate(self.procs):
            if proc.poll() is None:
                self.terminate(index)

    def kill_all(self) -> None:
        for proc, _log in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def disrupt(scenario: str, workers: Workers, monitor: Monitor, logs: Path) -> None:
    """rolling: each worker in turn stopped (SIGTERM) and started again; kill: one SIGKILLed, not
    started again, until every partition has committed since."""
    if scenario == "rolling":
        for index in range(WORKERS):
            workers.terminate(index)
            workers.wait_claimed(workers.start())
            time.sleep(5)
        return
    workers.kill(0)
    time.sleep(1)
    since = time.monotonic()
    deadline = since + 180
    while not all(m and m[-1][0] > since for m in monitor.moves.values()):
        if time.monotonic() > deadline:
            raise BenchmarkError(f"partitions never committed after the kill: see {logs}")
        time.sleep(0.1)


def drain(engine: sa.Engine, table: str, ends: dict[int, int]) -> None:
    """Until every produced message has its row (at most two minutes; the check says what is missing)."""
    deadline = time.monotonic() + 120
    while check_rows(engine, table, ends)["rows"] < sum(ends.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)


def run_one(config: Config, scenario: str, dsn: str, bootstrap: str, rate: float, out: Path) -> dict[str, Any]:
    """One scenario on one configuration: its stalls and its exactly-once check."""
    run_id = uuid.uuid4().hex[:8]
    topic, group, table = f"reb-{run_id}", f"reb-{run_id}", f"reb_effects_{run_id}"
    engine = sa.create_engine(dsn)
    create_topic(bootstrap, topic, PARTITIONS)
    create_table(engine, table)
    logs = out / f"{scenario}-{config.client}-{config.protocol}-{run_id}"
    logs.mkdir(parents=True)
    workers = Workers(config, dsn, bootstrap, topic, group, table, logs)
    monitor = Monitor(engine, group)
    producer = SteadyProducer(bootstrap, topic, rate)
    try:
        for _ in range(WORKERS):
            workers.wait_claimed(workers.start())
        deadline = time.monotonic() + 60
        while not monitor.settled():
            if time.monotonic() > deadline:
                raise BenchmarkError("the group never committed on every partition")
            time.sleep(0.1)
        time.sleep(8)  # the joins' rebalances are over
        start = monitor.record()
        time.sleep(3)
        disrupt(scenario, workers, monitor, logs)
        time.sleep(8)
        ends = producer.stop()
        end = time.monotonic()
        drain(engine, table, ends)
        monitor.stop()
        workers.stop_all()
        checked = check_rows(engine, table, ends)
        problems = checked["problems"] + check_offsets(engine, Settings(dsn=dsn), group, topic, ends)
        if problems:
            raise BenchmarkError(f"{config.name}, {scenario}: not exactly once: {problems[:5]} (logs: {logs})")
        longest, kept = monitor.stalls(start, end)
        return {"config": config.name, "client": config.client, "protocol": config.protocol, "scenario": scenario,
                "session_env": config.env, "max_stall_s": round(max(longest.values()), 2),
                "max_stall_kept_s": round(max(kept.values()), 2), "messages": checked["rows"],
                "exactly_once": True, "logs": str(logs)}
    finally:
        with contextlib.suppress(Exception):
            producer.stop()
        monitor.stop()
        workers.kill_all()
        drop_table(engine, table)
        engine.dispose()


@contextlib.contextmanager
def services(dsn: str | None, bootstrap: str | None) -> Iterator[tuple[str, str]]:
    with contextlib.ExitStack() as stack:
        if dsn is None:
            dsn = stack.enter_context(local_postgres()).dsn
        if bootstrap is None:
            bootstrap = stack.enter_context(local_kafka())
        yield dsn, bootstrap


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| configuration | rolling restart: longest stall | of a partition that did not move "
             "| SIGKILL of 1 of 3: longest stall | of a partition that did not move |", "|---|---:|---:|---:|---:|"]
    for config in dict.fromkeys(r["config"] for r in results):
        cells = []
        for scenario in SCENARIOS:
            runs = [r for r in results if r["config"] == config and r["scenario"] == scenario]
            cells += [" / ".join(f"{r[key]:.1f}" for r in runs) + (" s" if runs else "")
                      for key in ("max_stall_s", "max_stall_kept_s")]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rebalance", description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=600.0, help="messages a second (default 600)")
    parser.add_argument("--only", default=None, help="configurations whose name contains this")
    parser.add_argument("--scenario", choices=SCENARIOS, default=None, help="one scenario (default both)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each configuration and scenario")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    configs = [c for c in CONFIGS if args.only is None or args.only in c.name]
    scenarios = [args.scenario] if args.scenario else list(SCENARIOS)
    args.out.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="rebalance-", dir=args.out))
    results = []
    try:
        with services(args.dsn, args.bootstrap_servers) as (dsn, bootstrap):
            migrate(Settings(dsn=dsn))
            for _ in range(args.repeat):
                for config in configs:
                    for scenario in scenarios:
                        result = run_one(config, scenario, dsn, bootstrap, args.rate, out)
                        print(json.dumps(result), flush=True)
                        results.append(result)
    except BenchmarkError as exc:
        print(f"rebalance: error: {exc}", file=sys.stderr)
        return 1
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{platform.node()}, {os.cpu_count()} cores, {when}, {args.rate:g} msg/s, {PARTITIONS} partitions, "
          f"{WORKERS} workers; each cell: one value per run\n")
    print(table(results))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
