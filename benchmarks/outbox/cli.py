"""Command line of the outbox benchmark: ``python -m benchmarks.outbox [options]``."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import report as side_by_side
from ..cli import DEFAULT_OUT, services_for
from ..runner import say
from ..spawn import BenchmarkError
from . import report
from .runner import CONTENDERS, Contender, Options, OutboxRunner

#: ``--tiny``: only proves it still works (the CI smoke test); the numbers mean nothing.
TINY = {"messages": 2000, "partitions": 2, "rate": 500.0, "seconds": 2.0, "warmup": 0.5, "broker_warmup": 0.0}


def parse(argv: Sequence[str] | None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.outbox",
        description="kstore's Processor.produce() (outbox + relay) against two Kafka -> PostgreSQL -> Kafka "
                    "loops written by hand: throughput until visible, commit-to-visible latency "
                    "(docs/benchmarks.md).")
    add = parser.add_argument
    add("--messages", type=int, default=100_000, help="backlog each contender drains (default 100,000)")
    add("--partitions", type=int, default=8, help="partitions of every topic (default 8)")
    add("--size", type=int, default=100, help="bytes per input message (default 100)")
    add("--rate", type=float, default=5000.0, help="input messages (and so records) per second in the steady "
                                                   "phase (default 5000)")
    add("--seconds", type=float, default=20.0, help="length of the steady phase (default 20)")
    add("--warmup", type=float, default=2.0,
        help="leading seconds of the steady phase left out of the percentiles (default 2)")
    add("--broker-warmup", type=float, default=5.0,
        help="seconds of an unreported steady phase first, so the first contender does not meet a cold "
             "broker (default 5; 0 skips it)")
    add("--only", default=None, help="comma-separated contender names or numbers, e.g. 1,3")
    add("--tiny", action="store_true", help="a few seconds' run that only proves it works (CI's smoke test)")
    add("--bootstrap-servers", default=None, help="use this Kafka instead of starting a local one")
    add("--dsn", default=None, help="use this PostgreSQL (postgresql+psycopg2://...) instead of a throwaway one")
    add("--out", type=Path, default=DEFAULT_OUT, help="where the JSON and the logs go")
    add("--timeout", type=float, default=1800.0, help="seconds a contender may take per phase (default 1800)")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    if args.warmup >= args.seconds:
        parser.error("--warmup must be shorter than --seconds")
    opts = Options(messages=args.messages, partitions=args.partitions, size=args.size, rate=args.rate,
                   seconds=args.seconds, warmup=args.warmup, broker_warmup=args.broker_warmup, out=args.out,
                   timeout=args.timeout)
    return opts, args


def select(only: str | None) -> list[Contender]:
    if not only:
        return list(CONTENDERS)
    keys = {k.strip() for k in only.split(",") if k.strip()}
    known = {c.name for c in CONTENDERS} | {str(c.number) for c in CONTENDERS}
    if keys - known:
        raise ValueError(f"unknown contender(s) {', '.join(sorted(keys - known))}; choose from "
                         + ", ".join(f"{c.number}={c.name}" for c in CONTENDERS))
    return [c for c in CONTENDERS if c.name in keys or str(c.number) in keys]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes Ctrl-C's path: the children and the services are stopped


def _run_all(runner: OutboxRunner, contenders: list[Contender], opts: Options, results: dict[str, Any]) -> None:
    runner.prepare()
    if opts.broker_warmup > 0:
        runner.warm_up(contenders[0])
    for i, c in enumerate(contenders, 1):
        say(f"[{i}/{len(contenders)}] {c.number}. {c.label}")
        results["contenders"].append(runner.run(c))


def main(argv: Sequence[str] | None = None) -> int:
    opts, args = parse(argv)
    try:
        contenders = select(args.only)
    except ValueError as exc:
        print(f"python -m benchmarks.outbox: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    results: dict[str, Any] = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "parameters": {k: getattr(opts, k) for k in ("messages", "partitions", "size", "rate", "seconds",
                                                     "warmup", "broker_warmup")},
        "machine": side_by_side.machine(), "contenders": [],
    }
    code = 0
    try:
        with services_for(args) as (bootstrap, dsn, pids):
            runner = OutboxRunner(opts, bootstrap, dsn, pids)
            try:
                _run_all(runner, contenders, opts, results)
            finally:
                runner.cleanup(delete_topics=args.bootstrap_servers is not None)
    except BenchmarkError as exc:
        say(f"FAILED: {exc}")
        results["failed"], code = str(exc), 1
    except KeyboardInterrupt:
        say("interrupted")
        results["failed"], code = "interrupted", 130
    finally:
        results["duration_s"] = round(time.monotonic() - started, 1)
        results["ratios"] = report.ratios(results["contenders"])
        results["target"] = report.target(results["contenders"])
        path = opts.out / "outbox.json"
        report.write_json(results, path)
        if results["contenders"]:
            print()
            print(report.table(results))
            print()
        say(f"results in {path}; took {results['duration_s'] / 60:.1f} min")
    return code
