"""Command line of the benchmark: ``python -m benchmarks [options]``."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from kstore_devbroker.broker import DEFAULT_VERSION
from kstore_devbroker.registry import REGISTRY_VERSION

from . import report, services
from .contenders import CONTENDERS, Contender, select
from .profiling import py_spy
from .runner import Options, Runner, say
from .spawn import BenchmarkError

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse(argv: Sequence[str] | None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="kstore side by side with kafka-python, confluent-kafka and an at-least-once loop "
                    "(docs/benchmarks.md).",
    )
    add = parser.add_argument
    add("--messages", type=int, default=1_000_000, help="backlog each contender drains (default 1,000,000)")
    add("--partitions", type=int, default=12, help="partitions of every topic (default 12)")
    add("--size", type=int, default=100, help="bytes per message value (default 100)")
    add("--rate", type=float, default=5000.0, help="messages/s in the latency phase (default 5000)")
    add("--latency-seconds", type=float, default=20.0, help="length of the latency phase (default 20)")
    add("--latency-repeats", type=int, default=1,
        help="latency phases per contender; the one with the median p99 is reported, every phase's p99 "
             "beside it (default 1; a p99 target wants 3 or more)")
    add("--drains", type=int, default=1,
        help="throughput phases per contender; the one with the median msg/s is reported, every phase's "
             "msg/s beside it (default 1; a throughput target wants 3)")
    add("--latency-warmup", type=float, default=None,
        help="leading seconds of the latency phase left out of the percentiles (default: 20%% of it, at most 2)")
    add("--broker-warmup", type=float, default=60.0,
        help="seconds of an unreported latency phase first, so the first contender does not meet a cold "
             "broker (default 60; 0 skips it)")
    add("--per-message-txn-messages", dest="txn_messages", type=int, default=20_000,
        help="backlog of contender 7, one transaction per message (default 20,000)")
    add("--db-latency-ms", type=float, default=0.0,
        help="put a proxy between every contender and PostgreSQL that delays each direction by this "
             "much: a database on another machine (default 0: none)")
    add("--bootstrap-servers", default=None, help="use this Kafka instead of starting a local one")
    add("--dsn", default=None, help="use this PostgreSQL (postgresql+psycopg2://...) instead of a throwaway one")
    add("--schema-registry-url", default=None,
        help="the Avro contenders (29, 30): use this schema registry (Confluent's API) instead of starting a "
             "local one (Apicurio Registry, needs Java 21+); nothing is started when no Avro contender runs")
    add("--out", type=Path, default=DEFAULT_OUT, help="where the JSON, the chart and the logs go")
    add("--only", default=None, help="comma-separated contender names or numbers, e.g. 1,4 or kstore-noop")
    add("--timeout", type=float, default=3600.0, help="seconds a contender may take to drain (default 3600)")
    add("--quiet-wait", type=float, default=0.0,
        help="on a shared machine: before each phase, wait up to this many seconds for other processes "
             "to go quiet (default 0: do not wait)")
    add("--retries", type=int, default=0,
        help="run a phase again, up to this many times, while other processes disturbed it; the calmest "
             "attempt is reported (default 0)")
    add("--tiny", action="store_true",
        help="500 messages on 2 partitions (100 for contender 7), 0.3-second latency phases at 1,000/s, no "
             "broker warm-up: only proves every contender runs (CI's smoke test); the numbers mean nothing")
    add("--profile", nargs="?", const="threads", choices=("threads", "gil"), default=None,
        help="sample each contender (both phases) with py-spy, which slows it down a little; "
             "'--profile gil' samples only the thread holding the GIL: where the interpreter's time goes")
    args = parser.parse_args(argv)
    if args.tiny:
        # Each contender's cost here is its two child processes starting and joining their groups,
        # not its records: a few hundred prove the drain, the check and the percentiles as well.
        args.messages, args.partitions, args.txn_messages = 500, 2, 100
        args.rate, args.latency_seconds, args.broker_warmup = 1000.0, 0.3, 0.0
    if args.size < 20:
        parser.error("--size must be at least 20 bytes (the value carries its produce time)")
    if args.db_latency_ms < 0:
        parser.error("--db-latency-ms cannot be negative")
    if args.latency_repeats < 1:
        parser.error("--latency-repeats must be at least 1")
    if args.drains < 1:
        parser.error("--drains must be at least 1")
    if args.latency_warmup is not None and args.latency_warmup >= args.latency_seconds:
        parser.error("--latency-warmup must be shorter than --latency-seconds")
    opts = Options(
        messages=args.messages, partitions=args.partitions, size=args.size, rate=args.rate,
        latency_seconds=args.latency_seconds, latency_warmup=args.latency_warmup, txn_messages=args.txn_messages,
        out=args.out, only=args.only, timeout=args.timeout, profile=args.profile, broker_warmup=args.broker_warmup,
        quiet_wait=args.quiet_wait, retries=args.retries, latency_repeats=args.latency_repeats,
        drains=args.drains,
    )
    return opts, args


@contextlib.contextmanager
def services_for(args: argparse.Namespace) -> Iterator[tuple[str, str, list[int]]]:
    """The broker and the database: the ones given, or local ones started (and stopped) here.

    Also yields the pids of started services that are not this process's descendants.
    """
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap_servers
        if bootstrap is None:
            say("starting a local Apache Kafka broker (kstore_devbroker.broker, full JIT, 1 GB heap)")
            bootstrap = stack.enter_context(services.local_kafka())
        dsn, pids = args.dsn, []
        if dsn is None:
            say("starting a throwaway PostgreSQL (initdb + pg_ctl in a temp dir, default settings)")
            pg = stack.enter_context(services.local_postgres())
            dsn, pids = pg.dsn, [pg.pid]
        if getattr(args, "db_latency_ms", 0) > 0:  # the outbox benchmark has no such option
            say(f"PostgreSQL behind a proxy adding {args.db_latency_ms:g} ms each way")
            dsn = stack.enter_context(database_latency(dsn, args.db_latency_ms / 1000))
        yield bootstrap, dsn, pids


@contextlib.contextmanager
def registry_for(args: argparse.Namespace, contenders: list[Contender]) -> Iterator[str | None]:
    """The schema registry's URL when an Avro contender runs: the one given, or a local one started
    (and stopped) here; None when none runs."""
    if not any(c.workload == "avro" for c in contenders):
        yield None
    elif args.schema_registry_url:
        yield args.schema_registry_url
    else:
        say(f"starting a local schema registry (Apicurio Registry {REGISTRY_VERSION}, kstore_devbroker.registry)")
        with services.local_registry() as url:
            yield url


@contextlib.contextmanager
def database_latency(dsn: str, one_way_s: float) -> Iterator[str]:
    """``dsn`` through a TCP proxy (the tests' fault proxy) that delays each direction by ``one_way_s``."""
    from tests.support.faultproxy import FaultProxy

    url = make_url(dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        proxy.latency(one_way_s)
        yield proxy.dsn_through(dsn)


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM takes Ctrl-C's path, so the child, the broker and PostgreSQL are stopped.
    raise KeyboardInterrupt


def _parameters(opts: Options, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "messages": opts.messages, "partitions": opts.partitions, "size": opts.size, "rate": opts.rate,
        "latency_seconds": opts.latency_seconds, "latency_repeats": opts.latency_repeats,
        "latency_warmup_s": opts.warmup_s,
        "per_message_txn_messages": opts.txn_messages, "broker_warmup_s": opts.broker_warmup, "only": opts.only,
        "quiet_wait_s": opts.quiet_wait, "retries": opts.retries, "tiny": args.tiny,
        "kafka": "external (--bootstrap-servers)" if args.bootstrap_servers else
                 f"local Apache Kafka {DEFAULT_VERSION} (kstore_devbroker.broker)",
        "database": "external (--dsn)" if args.dsn else "throwaway local PostgreSQL, default settings",
        "schema_registry": None if not any(c.workload == "avro" for c in select(opts.only)) else
                           "external (--schema-registry-url)" if args.schema_registry_url else
                           f"local Apicurio Registry {REGISTRY_VERSION} (kstore_devbroker.registry)",
        "database_latency_ms_each_way": args.db_latency_ms,
    }


def _run_all(runner: Runner, opts: Options, results: dict[str, Any]) -> None:
    contenders = select(opts.only)
    runner.prepare(contenders)
    if opts.broker_warmup > 0:
        runner.warm_up(CONTENDERS[0])
    for i, c in enumerate(contenders, 1):
        say(f"[{i}/{len(contenders)}] {c.number}. {c.label}")
        results["contenders"].append(runner.run(c))


def _finish(results: dict[str, Any], opts: Options) -> None:
    """Ratios, the JSON file, the chart and the table: also after a failure, for what ran."""
    done = results["contenders"]
    results["ceilings"] = report.ceilings(done)
    results["ratios"] = report.ratios(done, results["machine"]["cpus"])
    results["rss_target"] = report.rss_target(done, opts.messages)
    results["latency_target"] = report.latency_target(done)
    json_path = opts.out / "benchmark.json"
    report.write_json(results, json_path)
    if not done:
        return
    chart_path = opts.out / "benchmark.png"
    drawn = report.chart(results, chart_path)
    print()
    print(report.table(results))
    print()
    say(f"results in {json_path}" + (f" and {chart_path}" if drawn else ""))


def main(argv: Sequence[str] | None = None) -> int:
    opts, args = parse(argv)
    try:
        select(opts.only)
        if opts.profile:
            py_spy()  # before any service starts: without it, one line, not a traceback minutes in
    except (ValueError, RuntimeError) as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    results: dict[str, Any] = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "parameters": _parameters(opts, args), "machine": report.machine(), "contenders": [],
    }
    code = 0
    try:
        with services_for(args) as (bootstrap, dsn, service_pids), \
                registry_for(args, select(opts.only)) as registry_url:
            runner = Runner(opts, bootstrap, dsn, service_pids, registry_url)
            results["machine"]["postgresql"] = runner.server_version()
            try:
                _run_all(runner, opts, results)
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
        _finish(results, opts)
    say(f"took {results['duration_s'] / 60:.1f} min")
    return code
