"""The parent's exactly-once checks after each phase: the effect rows, the stored offsets, and
the output topic read in full by a ``read_committed`` reader."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import sqlalchemy as sa

from .workload import Seen


def check_output(seen: Seen, ends: dict[int, int]) -> dict[str, Any]:
    """One record per input message, keyed by its key, and nothing else.

    Counts every (key, value) read: ``duplicates`` are copies beyond the first (the same record
    published twice); ``missing`` the input messages with no record.
    """
    sources: Counter[tuple[int, int]] = Counter()
    problems: list[str] = []
    for (key, value), n in seen.items():
        doc = json.loads(value)
        if key != doc["key"].encode():
            problems.append(f"record for {doc['src']} keyed {key!r}, expected {doc['key']!r}")
        sources[(int(doc["src"][0]), int(doc["src"][1]))] += n
    expected = {(p, o) for p, end in ends.items() for o in range(end)}
    missing = expected - set(sources)
    stray = set(sources) - expected
    repeated = {src: n for src, n in sources.items() if n > 1}
    duplicates = sum(n - 1 for n in seen.values() if n > 1)
    if missing:
        problems.append(f"{len(missing):,} input messages have no output record, e.g. {sorted(missing)[:5]}")
    if stray:
        problems.append(f"{len(stray):,} output records name no input message, e.g. {sorted(stray)[:5]}")
    if repeated:
        problems.append(f"{len(repeated):,} input messages have more than one output record "
                        f"({duplicates:,} exact duplicates), e.g. {sorted(repeated.items())[:5]}")
    return {"records": sum(seen.values()), "distinct": len(seen), "duplicates": duplicates,
            "missing": len(missing), "problems": problems}


def check_own_offsets(engine: sa.Engine, table: str, topic: str, ends: dict[int, int]) -> list[str]:
    """A hand-written loop's offsets table stands at the end of every partition that had messages."""
    with engine.connect() as conn:
        stored = {int(p): int(n) for p, n in conn.execute(
            sa.text(f"SELECT partition_id, next_offset FROM {table}_offsets WHERE topic = :t"), {"t": topic})}
    return [f"partition {p}: its stored next_offset {stored.get(p)}, expected {end}"
            for p, end in sorted(ends.items()) if end and stored.get(p) != end]


def rows_left(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
