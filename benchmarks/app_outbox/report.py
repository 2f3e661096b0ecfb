"""The application outbox benchmark's table, ratios and targets, printed and written as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KSTORE = "kstore-app-outbox"
BY_HAND = "publish-after-commit"
#: The targets, kstore over the by-hand loop of the same run: throughput at least, latency at most.
THROUGHPUT_AT_LEAST = 0.8
P50_AT_MOST = 2.0
P99_AT_MOST = 2.5


def table(results: dict[str, Any]) -> str:
    head = (f"{'phase':<10} {'contender':<21} {'req/s read':>10} {'req/s comm':>10} {'p50 ms':>7} {'p90 ms':>7} "
            f"{'p99 ms':>7} {'max ms':>7} {'commit p50/p99 ms':>17} {'CPU s':>6} {'relay CPU':>9}  records")
    lines = [head, "-" * len(head)]
    for phase in results["phases"]:
        for r in phase["contenders"]:
            lat, once = r["latency"], r["exactly_once"]
            commit = f"{r['commit_ms']['p50_ms']:.1f}/{r['commit_ms']['p99_ms']:.1f}"
            relay = f"{r['relay']['cpu_s']:>9.1f}" if "relay" in r else f"{'-':>9}"
            behind = "" if lat["kept_up"] else " FELL BEHIND"
            fate = ("once" if once["lost"] == 0 and once["duplicates"] == 0
                    else f"{once['lost']} lost, {once['duplicates']} dup")
            lines.append(f"{phase['name']:<10} {r['name']:<21} {r['readable_per_s']:>10,.0f} "
                         f"{r['committed_per_s']:>10,.0f} {lat['p50_ms']:>7.1f} {lat['p90_ms']:>7.1f} "
                         f"{lat['p99_ms']:>7.1f} {lat['max_ms']:>7.1f} {commit:>17} {r['cpu_s']:>6.1f} {relay}  "
                         f"{fate}{behind}")
    for t in results["targets"]:
        lines.append(f"{t['phase']:<10} kstore / by hand: {t['what']} x{t['ratio']:.2f} "
                     f"(target {t['target']}): {'met' if t['met'] else 'MISSED'}{t.get('note', '')}")
    return "\n".join(lines)


def targets(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each phase's ratios (kstore's over the by-hand loop's) against the targets: throughput until
    readable when flat out; p50 and p99 commit-to-readable latency (and throughput) at a fixed rate,
    which kstore must also have kept up with."""
    out: list[dict[str, Any]] = []
    for phase in phases:
        by_name = {r["name"]: r for r in phase["contenders"]}
        mine, theirs = by_name.get(KSTORE), by_name.get(BY_HAND)
        if mine is None or theirs is None:
            continue
        ratio = mine["readable_per_s"] / theirs["readable_per_s"]
        checks = [("throughput", ratio, f">= {THROUGHPUT_AT_LEAST:g}", ratio >= THROUGHPUT_AT_LEAST)]
        if phase["rate"]:
            ml, tl = mine["latency"], theirs["latency"]
            p50, p99 = ml["p50_ms"] / tl["p50_ms"], ml["p99_ms"] / tl["p99_ms"]
            checks += [("p50", p50, f"<= {P50_AT_MOST:g}", p50 <= P50_AT_MOST and ml["kept_up"]),
                       ("p99", p99, f"<= {P99_AT_MOST:g}", p99 <= P99_AT_MOST and ml["kept_up"])]
        for what, value, target, met in checks:
            t: dict[str, Any] = {"phase": phase["name"], "rate": phase["rate"], "what": what, "ratio": round(value, 3),
                                 "target": target, "met": met}
            if phase["rate"] and not mine["latency"]["kept_up"]:
                t["note"] = " (kstore fell behind the rate)"
            elif phase["rate"] and not theirs["latency"]["kept_up"]:
                t["note"] = " (the by-hand loop fell behind the rate)"
            out.append(t)
    return out


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
