"""The outbox benchmark's table, ratios and target, printed and written as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The targets: kstore's commit-to-visible latency at the steady rate over the at-most-once loop's
#: (COMMIT, then a plain send) in the same run, at most these. (A transaction's cost depends on the
#: cluster and the machine; the ratio says what exactly once costs on top of it.)
P50_TARGET_RATIO = 2.0
P99_TARGET_RATIO = 2.5
KSTORE = "kstore-produce"
YARDSTICK = "send-after-commit"


def table(results: dict[str, Any]) -> str:
    head = (f"{'contender':<46} {'msg/s visible':>13} {'msg/s commit':>12} {'CPU s':>6} {'RSS MB':>6} "
            f"{'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7}  output")
    lines = [head, "-" * len(head)]
    for c in results["contenders"]:
        t, s = c["throughput"], c.get("steady")
        lat = s["latency"] if s else None
        cells = (f"{lat['p50_ms']:>7.1f} {lat['p90_ms']:>7.1f} {lat['p99_ms']:>7.1f} {lat['max_ms']:>7.1f}" if lat
                 else f"{'-':>7} {'-':>7} {'-':>7} {'-':>7}")
        behind = "" if not lat or lat["kept_up"] else " FELL BEHIND"
        once = "once" if not t["exactly_once"]["duplicates"] and not (s and s["exactly_once"]["duplicates"]) else "DUP"
        lines.append(f"{c['number']}. {c['label']:<43} {t['visible_msgs_per_s']:>13,.0f} "
                     f"{t['committed_msgs_per_s']:>12,.0f} {t['cpu_s']:>6.1f} {t['peak_rss_mb']:>6.0f} "
                     f"{cells}  {once}{behind}")
    for r in results["ratios"]:
        lines.append(f"kstore vs {r['against']}: throughput x{r['throughput']:.2f}, "
                     f"p50 x{r['p50']:.2f}, p99 x{r['p99']:.2f} (latency: lower is better)")
    for t in results["target"]:
        lines.append(f"target at {t['rate']:,.0f} records/s: p50 x{t['p50']:.2f} <= x{t['p50_target']:g}, "
                     f"p99 x{t['p99']:.2f} <= x{t['p99_target']:g} of {YARDSTICK}: {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def ratios(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kstore against each hand-written contender of the same run: throughput (until visible) and
    latency percentiles as kstore's over theirs."""
    by_name = {c["name"]: c for c in done}
    mine = by_name.get(KSTORE)
    if mine is None or "steady" not in mine:
        return []
    out = []
    for c in done:
        if c["name"] == KSTORE or "steady" not in c:
            continue
        ml, tl = mine["steady"]["latency"], c["steady"]["latency"]
        out.append({"against": c["name"],
                    "throughput": mine["throughput"]["visible_msgs_per_s"] / c["throughput"]["visible_msgs_per_s"],
                    "p50": ml["p50_ms"] / tl["p50_ms"], "p99": ml["p99_ms"] / tl["p99_ms"]})
    return out


def target(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kstore's latency ratios over the at-most-once loop's against the targets (none unless both ran)."""
    by_name = {c["name"]: c for c in done}
    mine = by_name.get(KSTORE)
    if mine is None or "steady" not in mine:
        return []
    for r in ratios(done):
        if r["against"] == YARDSTICK:
            met = r["p50"] <= P50_TARGET_RATIO and r["p99"] <= P99_TARGET_RATIO and mine["steady"]["latency"]["kept_up"]
            return [{"rate": mine["steady"]["rate"], "p50": r["p50"], "p99": r["p99"], "p50_target": P50_TARGET_RATIO,
                     "p99_target": P99_TARGET_RATIO, "met": met}]
    return []


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
