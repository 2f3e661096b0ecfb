"""The side-by-side benchmark's contenders and ratios hang together (no broker, no database)."""

from __future__ import annotations

from benchmarks.contenders import CONTENDERS
from benchmarks.runner import table_name


def test_an_effects_table_and_its_offsets_table_keep_apart_within_postgresqls_63_bytes() -> None:
    names = set()
    for c in CONTENDERS:
        for phase in ("throughput", "latency"):
            for suffix in ("", "-again1", "-sweep0"):
                table = table_name("0123abcd", f"{c.number}-{c.name}-b5000-p1000-{phase}{suffix}")
                assert len(table + "_offsets") <= 63
                names.add(table)
    assert len(names) == len(CONTENDERS) * 6
    assert table_name("0123abcd", "12-exactly-once-by-hand-latency") == "bench_0123abcd_12_exactly_once_by_hand_latency"
