"""The web console on a big installation: how long its overview takes on the server, and what its
lag sampling asks of the database.

The targets: with 3 groups of 600 partitions each and 1,000,000 dead letters, the overview page
of a group is served in under 300 ms, and one round of sampling (every group) sends the database
fewer statements than there are groups.

    .venv/bin/python -m benchmarks.console [--groups 3] [--partitions 600] [--letters 1000000]
                                           [--loads 20] [--bootstrap-servers H:P] [--dsn URL]

Each group has its own topic of ``--partitions`` partitions, ten records in each, and a stored
offset of 5 on every partition (so every partition lags, and the page shows each one's age). The
dead letters are spread over the groups and partitions, nine in ten waiting, the rest replayed;
the table is vacuumed and analyzed afterwards, as autovacuum keeps a real one. The page is asked
for through the console's ASGI app in this process (Starlette's test client, read-only), so a
load's time is the server's: the database, the brokers and the template, no network or browser.
The first load of each group reads each lagging partition's oldest record from the brokers, as a
console does once after it starts; it is reported apart, and the target is judged on the median
and the 90th percentile of the loads after it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from kstore import Settings, migrate
from kstore.db import deadletters
from kstore.db.store import Store, make_engine
from kstore.db.writes import now

from .services import local_kafka, local_postgres_dsn

#: The server's time for one overview, judged on the median and the 90th percentile of the warm loads.
TARGET_MS = 300.0
#: Records put in every partition; the stored offsets sit at :data:`STORED`, so each partition lags.
RECORDS, STORED = 10, 5


def prepare(bootstrap: str, dsn: str, groups: int, partitions: int, letters: int) -> list[str]:
    """The topics, records, stored offsets and dead letters; returns the groups' names."""
    run = uuid.uuid4().hex[:8]
    names = [f"console-{run}-{g}" for g in range(groups)]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(n, partitions, 1) for n in names]).values():
        future.result(60)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for name in names:
        for p in range(partitions):
            for n in range(RECORDS):
                producer.produce(name, value=b"order %d" % n, partition=p)
                producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("the records were not all produced within 60 s")
    settings = Settings(dsn=dsn, bootstrap_servers=bootstrap)
    migrate(settings)
    engine = make_engine(settings)
    offsets = Store(engine, settings).offsets
    with engine.begin() as conn:
        conn.execute(offsets.insert(), [
            {"consumer_group": name, "topic": name, "partition_id": p, "next_offset": STORED, "epoch": 1,
             "updated_at": now()} for name in names for p in range(partitions)])
        _letters(conn, deadletters.build_table().name, names, partitions, letters)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"VACUUM ANALYZE {deadletters.build_table().name}")
    engine.dispose()
    return names


def _letters(conn: sa.Connection, table: str, groups: list[str], partitions: int, count: int) -> None:
    """``count`` dead letters in one statement, spread round the groups and their partitions."""
    conn.exec_driver_sql(
        f"""INSERT INTO {table} (consumer_group, topic, partition_id, "offset", key, value, headers, error,
                traceback, attempts, first_failure_at, last_failure_at, status)
            SELECT g.name, g.name, (i / %(groups)s) %% %(partitions)s, i, NULL, 'order'::bytea, '[]',
                   'ValueError: bad order ' || (i %% 7), 'Traceback (most recent call last): ...', 3,
                   now(), now(), CASE WHEN i %% 10 = 0 THEN 'replayed' ELSE 'dead' END
            FROM generate_series(0, %(count)s - 1) AS i
            JOIN unnest(%(names)s::text[]) WITH ORDINALITY AS g(name, n) ON g.n - 1 = i %% %(groups)s""",
        {"groups": len(groups), "partitions": partitions, "count": count, "names": groups})


def measure(bootstrap: str, dsn: str, groups: list[str], partitions: int, loads: int) -> dict[str, Any]:
    from starlette.testclient import TestClient

    from kstore.console import app

    settings = Settings(dsn=dsn, bootstrap_servers=bootstrap, console_read_only=True, console_sample_interval_s=0)
    web = app(settings, sample=False)
    out: dict[str, Any] = {"groups": {}}
    with TestClient(web) as client:
        for group in groups:
            times = []
            for _ in range(loads + 1):
                started = time.perf_counter()
                page = client.get(f"/groups/{group}")
                times.append((time.perf_counter() - started) * 1000)
                # Every partition's row, each lagging: the page read what the benchmark measures.
                shown = page.text.count(f'<td class="num lag">{RECORDS - STORED}</td>')
                if page.status_code != 200 or 'id="error"' in page.text or shown != partitions:
                    raise RuntimeError(f"the overview of {group} failed ({page.status_code}, {shown} of {partitions} "
                                       f"partitions lagging): {page.text[:500]}")
            warm = sorted(times[1:])
            out["groups"][group] = {"first_ms": times[0], "p50_ms": statistics.median(warm),
                                    "p90_ms": warm[int(0.9 * (len(warm) - 1))], "max_ms": warm[-1]}
        out["statements_per_sample"] = _statements(web.state.console.sampler.sample_once)
    return out


def _statements(sample: Any) -> int:
    """Statements any engine sent while ``sample()`` ran (one round of sampling, every group)."""
    sent = []

    def count(*_args: Any) -> None:
        sent.append(1)

    sa.event.listen(sa.Engine, "before_cursor_execute", count)
    try:
        sample()
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", count)
    return len(sent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.console", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=600)
    parser.add_argument("--letters", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=20, help="overview loads per group after the first")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap_servers or stack.enter_context(local_kafka())
        dsn = args.dsn or stack.enter_context(local_postgres_dsn())
        started = time.monotonic()
        groups = prepare(bootstrap, dsn, args.groups, args.partitions, args.letters)
        print(f"{args.groups} groups of {args.partitions:,} partitions, {args.letters:,} dead letters: "
              f"prepared in {time.monotonic() - started:.0f} s")
        result = measure(bootstrap, dsn, groups, args.partitions, args.loads)
    met = True
    for group, t in result["groups"].items():
        ok = t["p90_ms"] < TARGET_MS
        met = met and ok
        print(f"overview of {group}: first {t['first_ms']:.0f} ms, then p50 {t['p50_ms']:.0f} ms, "
              f"p90 {t['p90_ms']:.0f} ms, most {t['max_ms']:.0f} ms ({args.loads} loads; target < "
              f"{TARGET_MS:.0f} ms: {'met' if ok else 'NOT MET'})")
    statements = result["statements_per_sample"]
    sampled = statements < args.groups
    print(f"one round of sampling ({args.groups} groups) sent {statements} statements to the database "
          f"(target < {args.groups}: {'met' if sampled else 'NOT MET'})")
    return 0 if met and sampled else 1


if __name__ == "__main__":
    sys.exit(main())
