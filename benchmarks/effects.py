"""The parent's database work: effects tables, and the exactly-once check after every run.

An effects table has no key at all, so a message handled twice shows up as
two rows instead of being absorbed by a constraint.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from kstore import Settings


def create_table(engine: sa.Engine, name: str, columns: str = "payload bytea") -> None:
    """An effects table: ``partition_id`` and ``kafka_offset``, then ``columns`` (the value: its bytes,
    or the Avro workload's fields, ``avro.COLUMNS_SQL``)."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            f"CREATE TABLE {name} (partition_id integer NOT NULL, kafka_offset bigint NOT NULL, {columns})"
        ))


def drop_table(engine: sa.Engine, name: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))


def checkpoint(engine: sa.Engine) -> bool:
    """Flush the previous contender's dirty pages now, so the next one does not pay for them.

    Needs superuser (or pg_checkpoint) on a ``--dsn`` database; returns False if refused.
    """
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("CHECKPOINT"))
        return True
    except SQLAlchemyError:
        return False


def server_version(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.text("SHOW server_version")).scalar_one())


def check_rows(engine: sa.Engine, table: str, ends: dict[int, int]) -> dict[str, Any]:
    """Every offset ``0 .. end-1`` of every partition has exactly one row, and nothing else does."""
    query = sa.text(
        f"SELECT partition_id, count(*), count(DISTINCT kafka_offset), min(kafka_offset), max(kafka_offset) "
        f"FROM {table} GROUP BY partition_id"
    )
    with engine.connect() as conn:
        found = {int(p): (n, distinct, lo, hi) for p, n, distinct, lo, hi in conn.execute(query)}
    problems = [f"rows for partition {p}, which has no messages" for p in sorted(set(found) - set(ends))]
    for p, end in sorted(ends.items()):
        n, distinct, lo, hi = found.get(p, (0, 0, None, None))
        if end and (n, distinct, lo, hi) != (end, end, 0, end - 1):
            problems.append(f"partition {p}: {n} rows, {distinct} distinct offsets in [{lo}, {hi}], "
                            f"expected offsets 0..{end - 1} once each")
        elif not end and n:
            problems.append(f"partition {p}: {n} rows but no messages")
    total = sum(v[0] for v in found.values())
    distinct_total = sum(v[1] for v in found.values())
    return {"rows": total, "distinct": distinct_total, "expected": sum(ends.values()), "problems": problems}


def offsets_table(settings: Settings) -> sa.TableClause:
    """kstore's offsets table as DESIGN.md defines it (the contract, not kstore's internals)."""
    return sa.table(
        f"{settings.table_prefix}offsets",
        sa.column("consumer_group"), sa.column("topic"), sa.column("partition_id"), sa.column("next_offset"),
        schema=settings.schema,
    )


def check_offsets(engine: sa.Engine, settings: Settings, group: str, topic: str, ends: dict[int, int]) -> list[str]:
    """kstore's stored offsets for the group stand at the end of every partition."""
    o = offsets_table(settings)
    query = sa.select(o.c.partition_id, o.c.next_offset).where(o.c.consumer_group == group, o.c.topic == topic)
    with engine.connect() as conn:
        stored = {int(p): nxt for p, nxt in conn.execute(query)}
    return _offset_problems(stored, ends, "stored", skip_empty=False)


def _offset_problems(stored: dict[int, int], ends: dict[int, int], whose: str, *, skip_empty: bool) -> list[str]:
    """Partitions whose stored next offset is not their log end (empty ones left out if ``skip_empty``)."""
    return [
        f"partition {p}: {whose} next_offset {stored.get(p)}, expected {end}"
        for p, end in sorted(ends.items()) if (end or not skip_empty) and stored.get(p) != end
    ]


def check_own_offsets(engine: sa.Engine, table: str, group: str, topic: str, ends: dict[int, int]) -> list[str]:
    """The hand-written exactly-once loop's own offsets table stands at the end of every partition."""
    query = sa.text(f"SELECT partition_id, next_offset FROM {table} WHERE consumer_group = :g AND topic = :t")
    with engine.connect() as conn:
        stored = {int(p): nxt for p, nxt in conn.execute(query, {"g": group, "t": topic})}
    # It writes a partition's offset only once it has a message there.
    return _offset_problems(stored, ends, "its stored", skip_empty=True)


def forget_groups(engine: sa.Engine, settings: Settings, like: str) -> None:
    """Delete the offsets rows of the groups matching ``like`` (a finished run's)."""
    o = offsets_table(settings)
    with engine.begin() as conn:
        conn.execute(o.delete().where(o.c.consumer_group.like(like)))
