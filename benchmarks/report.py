"""What a run prints and writes: the table with ratios, the JSON file and the PNG chart."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from .contenders import BY_KEY, CEILINGS, LATENCY_JUDGED, RATIOS, RSS_TARGET_MB

#: Recorded with each run (None: not installed); kstore depends on neither driver, so all their packages.
PACKAGES = ("kstore", "kafka-python", "confluent-kafka", "SQLAlchemy", "psycopg2-binary", "psycopg2", "psycopg",
            "psycopg-binary", "fastavro")


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare numbers across machines."""
    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": _cpuinfo("model name"),
        "memory_gib": round(_meminfo_kib("MemTotal") / 1024**2, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    for name in PACKAGES:
        try:
            facts[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            facts[name] = None
    try:
        import confluent_kafka

        facts["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        pass
    return facts


def _cpuinfo(key: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _meminfo_kib(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_ceiling(contender: dict[str, Any], cores: int) -> float | None:
    """The most msg/s the contender's drain could reach on ``cores`` cores doing the same work: its
    messages over the CPU seconds the whole run (its process, the broker and the database) spent
    from its first message to its last, times the cores. Taking turns, waiting and the GIL only keep
    it lower. None when the run's CPU was not recorded."""
    cpu = contender.get("run_cpu_s")
    if not cpu:
        return None
    return float(contender["messages"] * cores / cpu)


def ratios(contenders: list[dict[str, Any]], cores: int | None = None) -> list[dict[str, Any]]:
    """The throughput ratios of :data:`~benchmarks.contenders.RATIOS` among the contenders that ran.

    With ``cores``, each ratio also has ``cpu_bound``: the numerator's :func:`cpu_ceiling` over the
    denominator's msg/s, the most the ratio could be on this machine without less work per message."""
    by_number = {c["number"]: c for c in contenders}
    out = []
    for r in RATIOS:
        num, den = by_number.get(r.numerator), by_number.get(r.denominator)
        if num is None or den is None:
            continue
        value = num["throughput_msgs_per_s"] / den["throughput_msgs_per_s"]
        ceiling = cpu_ceiling(num, cores) if cores else None
        out.append({
            "ratio": r.key, "numerator": num["name"], "denominator": den["name"], "value": value,
            "target": r.target, "met": None if r.target is None else value >= r.target, "section": r.section,
            **({"cpu_bound": ceiling / den["throughput_msgs_per_s"]} if ceiling is not None else {}),
        })
    return out


def rss_target(contenders: list[dict[str, Any]], messages: int) -> dict[str, Any] | None:
    """The memory target: kstore's peak RSS under 300 MB on the 1,000,000-message run."""
    kstore = [c for c in contenders if c["name"].startswith("kstore") and c["messages"] == messages]
    if not kstore:
        return None
    worst = max(kstore, key=lambda c: c["peak_rss_mb"])
    return {"contender": worst["name"], "peak_rss_mb": worst["peak_rss_mb"], "target_mb": RSS_TARGET_MB,
            "met": worst["peak_rss_mb"] < RSS_TARGET_MB, "messages": messages}


def latency_target(contenders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latency target: every kstore contender that writes, on psycopg2, with a p99 no higher than the
    hand-written exactly-once loop's on the same client (12, 19) at the same rate."""
    by_number = {c["number"]: c for c in contenders}
    out = []
    for baseline, judged in LATENCY_JUDGED.items():
        hand = by_number.get(baseline)
        if hand is None:
            continue
        limit = hand["latency"]["p99_ms"]
        out += [
            {"contender": c["name"], "p99_ms": c["latency"]["p99_ms"], "baseline": hand["name"],
             "baseline_p99_ms": limit, "met": c["latency"]["p99_ms"] <= limit and c["latency"].get("kept_up", True),
             **({"p99_ms_each": c["latency"]["p99_ms_each"], "baseline_p99_ms_each": hand["latency"]["p99_ms_each"]}
                if "p99_ms_each" in c["latency"] and "p99_ms_each" in hand["latency"] else {})}
            for c in contenders if c["number"] in judged
        ]
    return out


def ceilings(contenders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each client's raw loop (1, 2) that ran: the most that client drains here, writing nothing."""
    by_number = {c["number"]: c for c in contenders}
    return [
        {"client": client, "contender": by_number[n]["name"],
         "throughput_msgs_per_s": by_number[n]["throughput_msgs_per_s"]}
        for client, n in CEILINGS.items() if n in by_number
    ]


def _ms(lat: dict[str, Any], key: str) -> str:
    """A latency figure, starred when the contender fell behind the offered rate."""
    return f"{lat[key]:.1f}" + ("" if lat.get("kept_up", True) else "*")


def _noise(c: dict[str, Any]) -> str:
    """The larger share of a core other processes took during either phase (see noise.py)."""
    shares = [p["noise"]["other_cores"] for p in (c, c["latency"] or {}) if "noise" in p]
    return f"{max(shares):.2f}" if shares else "-"


def _cores(c: dict[str, Any]) -> str:
    """How many cores the run (contender, broker, database) kept busy while it drained."""
    cpu = c.get("run_cpu_s")
    return "-" if cpu is None else f"{cpu / c['seconds']:.2f}"


def _met(met: bool | None) -> str:
    return "reference" if met is None else ("met" if met else "NOT MET")


def table(results: dict[str, Any]) -> str:
    """The results as plain text, for stdout and for docs/benchmarks.md."""
    rows = [
        f"{'#':>2}  {'contender':<40} {'messages':>10} {'msg/s':>9} {'RSS MB':>7} {'CPU s':>7}   "
        f"{'cores':>5}   {'latency at':>10} {'p50 ms':>8} {'p99 ms':>8}  {'exactly-once':<12}  other CPU"
    ]
    for c in results["contenders"]:
        lat = c["latency"]
        latency = (f"{lat['rate']:>8,.0f}/s {_ms(lat, 'p50_ms'):>8} {_ms(lat, 'p99_ms'):>8}" if lat
                   else f"{'-':>10} {'-':>8} {'-':>8}")
        rows.append(
            f"{c['number']:>2}  {c['label']:<40} {c['messages']:>10,} {c['throughput_msgs_per_s']:>9,.0f} "
            f"{c['peak_rss_mb']:>7.0f} {c['cpu_s']:>7.1f} {_cores(c):>5}   {latency}  "
            f"{'passed' if c['exactly_once']['passed'] else 'FAILED':<12}  {_noise(c):>9}"
        )
    tops = ceilings(results["contenders"])
    if tops:
        rows += ["", "ceilings (raw loops, reading only): " + "; ".join(
            f"{t['client']} {t['throughput_msgs_per_s']:,.0f} msg/s" for t in tops)]
    rows += ["", "throughput ratios"]
    section = None
    for r in results["ratios"]:
        if r.get("section") and r["section"] != section:
            section = r["section"]
            rows.append(f" {section}")
        target = "" if r["target"] is None else f">= {r['target']:.2f}"
        bound = (f"  (the run's CPU on this machine's cores allows at most {r['cpu_bound']:.2f})"
                 if r["met"] is False and "cpu_bound" in r else "")
        rows.append(f"  {r['ratio']:>5}  {r['numerator']:<30} / {r['denominator']:<30} {r['value']:>6.2f}  "
                    f"{target:>8}  {_met(r['met'])}{bound}")
    if any(c["latency"] and not c["latency"].get("kept_up", True) for c in results["contenders"]):
        rows.append("  * fell behind the offered rate: its latency measures a growing backlog (see docs)")
    for t in results.get("latency_target", []):
        each = (f" (medians of {_each(t['p99_ms_each'])} and {_each(t['baseline_p99_ms_each'])})"
                if "p99_ms_each" in t else "")
        rows.append(f"  p99 of {t['contender']:<23} {t['p99_ms']:>7.1f} ms  <= {t['baseline']}'s "
                    f"{t['baseline_p99_ms']:.1f} ms: {_met(t['met'])}{each}")
    rows += main_threads(results["contenders"])
    rss = results.get("rss_target")
    if rss:
        rows.append(f"  peak RSS of kstore ({rss['contender']}, {rss['messages']:,} messages): "
                    f"{rss['peak_rss_mb']:.0f} MB, target < {rss['target_mb']} MB: {_met(rss['met'])}")
    return "\n".join(rows)


def main_threads(contenders: list[dict[str, Any]]) -> list[str]:
    """Where each kstore worker's main thread spent its drain (from the worker's own metrics): what
    is not in a batch, it waited for records the fetch thread had not yet queued."""
    rows = []
    for c in contenders:
        m = c.get("main_thread")
        if not m or not m["batches"] or not c["seconds"]:
            continue
        share = {k: 100 * m[k] / c["seconds"] for k in ("in_batches_s", "committing_s")}
        rows.append(f"  {c['number']:>2} {c['name']:<30} in batches {share['in_batches_s']:3.0f}% of the drain "
                    f"(handler and writes {share['in_batches_s'] - share['committing_s']:.0f}%, offsets and COMMIT "
                    f"{share['committing_s']:.0f}%), waiting for records {100 - share['in_batches_s']:.0f}%; "
                    f"{m['batches']:,} batches of {c['messages'] / m['batches']:,.0f} on average")
    return ["", "where each kstore worker's main thread spent the drain", *rows] if rows else []


def _each(values: list[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


#: Bar colours: the clients' own ceilings, the hand-written baseline, kstore.
COLOURS = {"raw": "#9A9A9A", "baseline": "#DD8452", "kstore": "#4C72B0"}


def _colour(c: dict[str, Any]) -> str:
    contender = BY_KEY.get(c["name"])
    if contender is None or contender.kstore:
        return COLOURS["kstore"]
    return COLOURS["baseline"] if contender.writes_rows else COLOURS["raw"]


def chart(results: dict[str, Any], path: Path) -> bool:
    """Throughput, latency and peak RSS side by side; False (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return False
    contenders = list(reversed(results["contenders"]))  # barh draws bottom-up: #1 on top
    labels = [f"{c['number']}. {c['label']}" for c in contenders]
    colours = [_colour(c) for c in contenders]
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.42 * len(labels) + 1.6), dpi=72, sharey=True)
    _bars(axes[0], labels, [c["throughput_msgs_per_s"] for c in contenders], colours,
          "drain throughput, messages/s (log scale)", "{:,.0f}", log=True)
    _latency_bars(axes[1], labels, contenders, results["parameters"]["rate"])
    _bars(axes[2], labels, [c["peak_rss_mb"] for c in contenders], colours, "peak RSS, MB", "{:.0f}")
    p = results["parameters"]
    fig.suptitle(f"kstore benchmark: {p['messages']:,} messages of {p['size']} bytes on {p['partitions']} "
                 f"partitions (#7: {p['per_message_txn_messages']:,}); {results['machine']['cpus']} cores",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plain_log_axis(ax: Any) -> None:
    """Log scale labelled 1, 10, 100 rather than 10^0, 10^1, 10^2."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _bars(ax: Any, labels: list[str], values: list[float], colours: list[str], title: str, fmt: str,
          log: bool = False) -> None:
    bars = ax.barh(labels, values, color=colours)
    ax.bar_label(bars, [fmt.format(v) for v in values], padding=3, fontsize=8)
    ax.set_title(title, fontsize=10)
    if log:
        _plain_log_axis(ax)
        ax.set_xlim(min(values) / 3, max(values) * 8)
    else:
        ax.set_xlim(0, max(values) * 1.3)
    ax.tick_params(labelsize=8)


def _latency_note(lat: dict[str, Any], rate: float) -> str:
    """The p99 label; says so when measured at a lower rate, or when the contender fell behind."""
    note = f"{lat['p99_ms']:,.1f}"
    if lat["rate"] != rate:
        note += f"  (at {lat['rate']:,.0f}/s)"
    if not lat.get("kept_up", True):
        note += "  fell behind"
    return note


def _latency_bars(ax: Any, labels: list[str], contenders: list[dict[str, Any]], rate: float) -> None:
    timed = [(i, c["latency"]) for i, c in enumerate(contenders) if c["latency"]]  # 28 has no latency phase
    if not timed:
        return
    p50 = [lat["p50_ms"] for _, lat in timed]
    p99 = [lat["p99_ms"] for _, lat in timed]
    ax.barh([i + 0.2 for i, _ in timed], p50, height=0.4, label="p50", color="#55A868")
    bars = ax.barh([i - 0.2 for i, _ in timed], p99, height=0.4, label="p99", color="#C44E52")
    notes = [_latency_note(lat, rate) for _, lat in timed]
    ax.bar_label(bars, notes, padding=3, fontsize=7)
    _plain_log_axis(ax)
    ax.set_xlim(min(p50) / 2, max(p99) * 20)
    for i, c in enumerate(contenders):
        if not c["latency"]:
            ax.text(min(p50) / 2, i, "  no latency phase: reads no Kafka while timed", fontsize=7, va="center")
    ax.set_title(f"latency at {rate:,.0f} msg/s, ms (log scale)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.tick_params(labelsize=8)
