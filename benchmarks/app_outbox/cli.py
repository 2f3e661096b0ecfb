"""Command line of the application outbox benchmark: ``python -m benchmarks.app_outbox [options]``."""

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
from .app import SHARDS
from .runner import CONTENDERS, AppRunner, Contender, Options

#: ``--tiny``: only proves it still works (the CI smoke test); the numbers mean nothing.
TINY: dict[str, Any] = {"requests": 300, "rate": "200", "seconds": 2.0, "warmup": 0.5, "broker_warmup": 0.0,
                        "reader_idle_s": 5.0}


def parse(argv: Sequence[str] | None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.app_outbox",
        description="Request transactions producing through kstore's application outbox (kstore.outbox.Outbox + "
                    "kstore relay --outbox) against the same transactions publishing after COMMIT by hand: "
                    "throughput until readable and commit-to-readable latency (docs/benchmarks.md).")
    add = parser.add_argument
    add("--requests", type=int, default=20_000, help="requests of the flat-out phase (default 20,000)")
    add("--rate", default="2000,5000",
        help="requests/s of the paced phases, comma-separated, one phase each (default 2000,5000; '' for none)")
    add("--seconds", type=float, default=20.0, help="length of each paced phase (default 20)")
    add("--warmup", type=float, default=2.0,
        help="leading seconds of each paced phase left out of the percentiles (default 2)")
    add("--threads", type=int, default=50, help="concurrent request threads per contender (default 50)")
    add("--partitions", type=int, default=8, help="partitions of each output topic (default 8)")
    add("--broker-warmup", type=float, default=5.0,
        help="seconds of unreported paced requests first (at the first rate, shared among the contenders), so "
             "no contender meets a cold broker (default 5; 0 skips it)")
    add("--only", default=None, help="comma-separated contender names or numbers (1=kstore-app-outbox, "
                                     "2=publish-after-commit); the ratios need both")
    add("--tiny", action="store_true", help="a few seconds' run that only proves it works (CI's smoke test)")
    add("--bootstrap-servers", default=None, help="use this Kafka instead of starting a local one")
    add("--dsn", default=None, help="use this PostgreSQL (postgresql+psycopg2://...) instead of a throwaway one")
    add("--out", type=Path, default=DEFAULT_OUT / "app_outbox.json",
        help="the JSON results (default benchmarks/results/app_outbox.json); logs in logs/app_outbox/ beside it")
    add("--relay-log-level", default="INFO", help="the relay's --log-level (DEBUG: where its time goes)")
    add("--timeout", type=float, default=1800.0, help="seconds a contender may take per phase (default 1800)")
    add("--shards", type=int, default=SHARDS,
        help=f"shards of the application outbox (default {SHARDS}, Outbox's default): how many requests commit "
             "records at once; fixed when first made, so a fresh database (--dsn) for another count")
    add("--switch-interval", type=float, default=None,
        help="sys.setswitchinterval() in the request processes (default Python's 0.005): a diagnosis of how long "
             "a request thread waits for the GIL between its round trips")
    add("--reader-idle-s", type=float, default=30.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    try:
        rates = tuple(float(r) for r in args.rate.split(",") if r.strip())
    except ValueError:
        parser.error(f"--rate: comma-separated numbers, got {args.rate!r}")
    if any(r <= 0 for r in rates):
        parser.error("--rate: each rate must be positive")
    if rates and args.warmup >= args.seconds:
        parser.error("--warmup must be shorter than --seconds")
    if min(args.threads, args.requests, args.shards) < 1:
        parser.error("--threads, --requests and --shards must be at least 1")
    opts = Options(requests=args.requests, rates=rates, seconds=args.seconds, warmup=args.warmup,
                   threads=args.threads, partitions=args.partitions, broker_warmup=args.broker_warmup,
                   out=args.out, timeout=args.timeout, reader_idle_s=args.reader_idle_s,
                   relay_log_level=args.relay_log_level, switch_interval=args.switch_interval,
                   shards=args.shards)
    return opts, args


def select(only: str | None) -> list[Contender]:
    if not only:
        return list(CONTENDERS)
    keys = {k.strip() for k in only.split(",") if k.strip()}
    numbered = {str(i): c for i, c in enumerate(CONTENDERS, 1)}
    known = {c.name for c in CONTENDERS} | set(numbered)
    if keys - known:
        raise ValueError(f"unknown contender(s) {', '.join(sorted(keys - known))}; choose from "
                         + ", ".join(f"{i}={c.name}" for i, c in numbered.items()))
    return [c for i, c in numbered.items() if c.name in keys or i in keys]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes Ctrl-C's path: the children, the relay and the services are stopped


def _run_all(runner: AppRunner, contenders: list[Contender], opts: Options, results: dict[str, Any]) -> None:
    runner.prepare()
    if opts.broker_warmup > 0:
        rate = opts.rates[0] if opts.rates else 1000.0
        share = opts.broker_warmup / len(contenders)
        say(f"warming up the broker: {share:g} s of each contender at {rate:,.0f} requests/s (not reported)")
        for c in contenders:
            results["warmup"].append({"name": c.name, **runner.phase(c, "warmup", rate, seconds=share)})
    phases: list[tuple[str, float | None]] = [("flat-out", None)] + [(f"{r:g}/s", r) for r in opts.rates]
    for name, rate in phases:
        if rate is None:
            say(f"flat out: {opts.requests:,} requests on {opts.threads} threads")
        else:
            say(f"paced: {rate:,.0f} requests/s for {opts.seconds:g} s on {opts.threads} threads")
        done: dict[str, Any] = {"name": name, "rate": rate, "contenders": []}
        results["phases"].append(done)
        for c in contenders:
            done["contenders"].append({"name": c.name, "label": c.label, **runner.phase(c, name, rate)})


def main(argv: Sequence[str] | None = None) -> int:
    opts, args = parse(argv)
    try:
        contenders = select(args.only)
    except ValueError as exc:
        print(f"python -m benchmarks.app_outbox: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    results: dict[str, Any] = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "parameters": {k: getattr(opts, k) for k in ("requests", "rates", "seconds", "warmup", "threads",
                                                     "partitions", "broker_warmup", "switch_interval", "shards")},
        "machine": side_by_side.machine(), "warmup": [], "phases": [],
    }
    code = 0
    try:
        with services_for(args) as (bootstrap, dsn, pids):
            runner = AppRunner(opts, bootstrap, dsn, pids)
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
        results["targets"] = report.targets(results["phases"])
        report.write_json(results, opts.out)
        if results["phases"]:
            print()
            print(report.table(results))
            print()
        say(f"results in {opts.out}; took {results['duration_s'] / 60:.1f} min")
    return code
