"""``python -m benchmarks.sweep``: the hand-written (and raw) loops' batch sizes tried, the fastest named.

The headline ratios are only fair against baselines at their best, so the batch
size a loop fetches (kafka-python's ``max_poll_records``, confluent-kafka's
``consume(num_messages)``) and the rows per ``execute_values`` statement
(``page_size``; 0 is the whole batch in one) are tried here over a grid, each
combination draining the same backlog in its own child as in the main run
(throughput only, checked exactly-once). It prints msg/s per combination and the
winner per loop; ``TUNED_KAFKA_PYTHON`` and ``TUNED_CONFLUENT`` in
``benchmarks/contenders.py`` hold the values picked this way (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .cli import DEFAULT_OUT, _interrupt, services_for
from .contenders import BY_KEY, CONTENDERS, Contender
from .report import machine, write_json
from .runner import Options, Runner, say
from .spawn import BenchmarkError

#: The loops it tunes by default: the hand-written exactly-once loops, the ratios' denominators.
DEFAULT_LOOPS = "12,19"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--loops", default=DEFAULT_LOOPS,
        help=f"raw or hand-written contenders to tune, by number or name (default {DEFAULT_LOOPS}; "
             "1, 2, 11, 12, 19, 20 take it)")
    add("--batches", default="500,1000,2000,5000", help="records per poll / consume() to try")
    add("--pages", default="100,1000,0", help="execute_values page sizes to try (0: the whole batch)")
    add("--backoffs", default="1000,100,10",
        help="confluent-kafka's loops: librdkafka fetch.queue.backoff.ms values to try (its default is 1000)")
    add("--repeat", type=int, default=1, help="drains per combination, interleaved; the median is compared")
    add("--messages", type=int, default=100_000, help="backlog each drain takes (default 100,000)")
    add("--partitions", type=int, default=12)
    add("--size", type=int, default=100)
    add("--broker-warmup", type=float, default=5.0, help="seconds of an unreported phase first (0: none)")
    add("--quiet-wait", type=float, default=0.0,
        help="before each drain, wait up to this many seconds for other processes to go quiet (default 0)")
    add("--bootstrap-servers", default=None, help="use this Kafka instead of starting a local one")
    add("--dsn", default=None, help="use this PostgreSQL instead of a throwaway one")
    add("--out", type=Path, default=DEFAULT_OUT, help="where sweep.json and the logs go")
    add("--tiny", action="store_true",
        help="500 messages on 2 partitions, one batch size, two page sizes: only proves it works (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.messages, args.partitions, args.batches, args.pages, args.broker_warmup = 500, 2, "1000", "100,0", 0
        args.backoffs = "100"
    return args


def variants(loops: list[Contender], batches: list[int], pages: list[int],
             backoffs: Sequence[int] = ()) -> list[Contender]:
    """Each loop with each batch size (each page size, if it writes; each fetch backoff, if on
    confluent-kafka; none given: librdkafka's default), named by them."""
    out = []
    for c in loops:
        confluent = c.client == "confluent"
        key = "consume_batch" if confluent else "max_poll_records"
        for batch in batches:
            for page in pages if c.writes_rows else [None]:
                for backoff in (backoffs or [None]) if confluent else [None]:
                    tuning: dict[str, Any] = {key: batch}
                    suffix = f"b{batch}"
                    if page is not None:
                        tuning["page_size"], suffix = page, f"{suffix}-p{page}"
                    if backoff is not None:
                        tuning["fetch_queue_backoff_ms"], suffix = backoff, f"{suffix}-q{backoff}"
                    out.append(dataclasses.replace(c, name=f"{c.name}-{suffix}", tuning=tuning))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        loops = [BY_KEY[k.strip()] for k in args.loops.split(",") if k.strip()]
    except KeyError as exc:
        print(f"python -m benchmarks.sweep: unknown contender {exc}", file=sys.stderr)
        return 2
    tunable = [c for c in loops if not c.kstore and c.entry.startswith(("benchmarks.raw_loops:",
                                                                        "benchmarks.handwritten:",
                                                                        "benchmarks.confluent_loops:"))]
    if tunable != loops or any(c.number == 3 for c in loops):
        print("python -m benchmarks.sweep: only the raw and hand-written loops (1, 2, 11, 12, 19, 20) take a "
              "tuning", file=sys.stderr)
        return 2
    runs = variants(loops, _ints(args.batches), _ints(args.pages), _ints(args.backoffs))
    signal.signal(signal.SIGTERM, _interrupt)  # as the main run: the child, the broker and PostgreSQL stop
    opts = Options(messages=args.messages, partitions=args.partitions, size=args.size, out=args.out,
                   broker_warmup=args.broker_warmup, quiet_wait=args.quiet_wait)
    results: dict[str, Any] = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "parameters": {"messages": args.messages, "partitions": args.partitions, "size": args.size,
                       "repeat": args.repeat, "loops": args.loops, "batches": args.batches, "pages": args.pages,
                       "backoffs": args.backoffs,
                       "quiet_wait_s": args.quiet_wait},
        "machine": machine(), "drains": [],
    }
    code = 0
    try:
        with services_for(args) as (bootstrap, dsn, service_pids):
            runner = Runner(opts, bootstrap, dsn, service_pids)
            try:
                runner.prepare(runs)
                if opts.broker_warmup > 0:
                    runner.warm_up(CONTENDERS[0])
                for attempt in range(args.repeat):
                    for i, c in enumerate(runs, 1):
                        say(f"[{attempt * len(runs) + i}/{args.repeat * len(runs)}] {c.number}. {c.name}")
                        drained = runner.drain(c, suffix=f"-sweep{attempt}")
                        results["drains"].append({"number": c.number, "name": c.name, "tuning": c.tuning,
                                                  **drained})
            finally:
                runner.cleanup(delete_topics=args.bootstrap_servers is not None)
    except BenchmarkError as exc:
        say(f"FAILED: {exc}")
        results["failed"], code = str(exc), 1
    except KeyboardInterrupt:
        say("interrupted")
        results["failed"], code = "interrupted", 130
    results["summary"] = summary(results["drains"])
    write_json(results, args.out / "sweep.json")
    print()
    print(table(results["summary"]))
    return code


def summary(drains: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per combination the median msg/s of its drains, and whether it won its loop."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for d in drains:
        by_name.setdefault(d["name"], []).append(d)
    rows = [
        {"number": ds[0]["number"], "name": name, "tuning": ds[0]["tuning"],
         "msgs_per_s": statistics.median(d["throughput_msgs_per_s"] for d in ds),
         "runs": [round(d["throughput_msgs_per_s"]) for d in ds],
         "other_cores": max(d["noise"]["other_cores"] for d in ds)}
        for name, ds in by_name.items()
    ]
    for number in {r["number"] for r in rows}:
        best = max((r for r in rows if r["number"] == number), key=lambda r: r["msgs_per_s"])
        best["best"] = True
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'#':>2}  {'loop':<46} {'tuning':<42} {'msg/s':>9}  {'runs':<24} other CPU"]
    for r in rows:
        tuning = ", ".join(f"{k}={v}" for k, v in r["tuning"].items())
        runs = ", ".join(f"{v:,}" for v in r["runs"])
        lines.append(f"{r['number']:>2}  {r['name']:<46} {tuning:<42} {r['msgs_per_s']:>9,.0f}  {runs:<24} "
                     f"{r['other_cores']:>9.2f}" + ("  <- fastest" if r.get("best") else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
