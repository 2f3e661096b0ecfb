"""The metrics docs/observability.md lists, scraped from a real `kstore worker`'s /metrics while
the thing they count happens: retries, batch and commit durations, a COMMIT in doubt resolved as
landed, the buffered records and bytes, which `max_buffered_bytes` bounds (fetching pauses), and
every outbox metric it names, on a worker that produces (its relay's included)."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from tests.support.faultproxy import FaultProxy
from tests.support.harness import REPO_DIR, assert_exactly_once, effects, stored_offsets, wait_until
from tests.support.outbox_processors import copies
from tests.support.outbox_processors import metadata as booker_tables

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def port_of(w: Any) -> int:
    pattern = r"serving /metrics, /livez and /readyz on http://[^:]+:(\d+)"
    w.wait_for_log(pattern, timeout=180)  # a loaded machine can take a minute to start a worker
    return int(re.search(pattern, w.log).group(1))  # type: ignore[union-attr]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture
def pg_proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    url = make_url(pg_dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy


def test_retries_and_batch_and_commit_durations_move(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    """A message failing 3 attempts counts 2 retries (attempts beyond its first) and one dead
    letter; every committed batch is observed once in each duration histogram."""
    topic = new_topic(partitions=1)
    sent = produce(topic, (f"v{i}" for i in range(30)), partition=0)
    (poison,) = produce(topic, ["poison"], partition=0)
    w = workers(pg_dsn, topic, "metrics-retries", env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--metrics-port", "0", "--on-error", "dead_letter", "--max-attempts", "3"])
    port = port_of(w)
    before = scrape(port)
    assert total(before, "kstore_retries_total") == 0
    s = wait_until(lambda: (lambda s: s if total(s, "kstore_dead_letters_written_total") == 1 else None)(scrape(port)),
                   60, what="the dead letter counted")
    assert total(s, "kstore_retries_total") == 2
    wait_until(lambda: stored_offsets(pg_dsn, "metrics-retries") == {(topic, 0): 31}, 30, what="offset 31")
    s = scrape(port)
    batches = total(s, "kstore_batches_committed_total")
    assert batches >= 1
    assert total(s, "kstore_batch_duration_seconds_count") == batches
    assert total(s, "kstore_batch_duration_seconds_sum") > 0
    assert total(s, "kstore_commit_duration_seconds_count") >= batches
    assert 0 < total(s, "kstore_commit_duration_seconds_sum") <= total(s, "kstore_batch_duration_seconds_sum")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), set(sent))
    assert poison not in effects(pg_dsn)


def test_a_commit_in_doubt_found_landed_is_counted(
    pg_dsn: str, pg_proxy: FaultProxy, new_topic: Callable[..., str], produce: Callable[..., Any],
    workers: Callable[..., Any],
) -> None:
    topic = new_topic(partitions=1)
    expected = set(produce(topic, (f"a{i}" for i in range(20)), partition=0))
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "metrics-doubt", args=["--metrics-port", "0"])
    port = port_of(w)
    wait_until(lambda: len(effects(pg_dsn)) == 20, 60, what="the first 20 effects")
    assert total(scrape(port), "kstore_in_doubt_resolved_total") == 0
    pg_proxy.cut_after_commit(touching="kstore_offsets")  # a batch's (the relay commits through the proxy too)
    expected |= set(produce(topic, (f"b{i}" for i in range(20)), partition=0))
    wait_until(lambda: pg_proxy.commits_cut >= 1, 60, what="a COMMIT's answer cut")
    wait_until(lambda: total(scrape(port), "kstore_in_doubt_resolved_total", outcome="landed") == 1, 60,
               what="the in-doubt resolution counted")
    wait_until(lambda: len(effects(pg_dsn)) >= 40, 60, what="all 40 effects")
    assert total(scrape(port), "kstore_in_doubt_resolved_total", outcome="not_landed") == 0
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), expected)


#: A small bound, records of 10 kB, and at most 50 records per poll: "one fetch" is at most 50 records.
MAX_BUFFERED = 1_000_000
VALUE_BYTES = 10_000
POLL_RECORDS = 50
RECORD_OVERHEAD = 200  # kstore.kafka.seam's estimate of a record's memory beside its key and value


@pytest.mark.contract
def test_buffered_bytes_stay_within_max_buffered_bytes_plus_one_fetch(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    """A 15 MB backlog and a slow processor: the queues fill to the bound and fetching pauses;
    the buffered bytes never exceed ``max_buffered_bytes`` by more than one poll's records.
    (The record limit, twice the batch size, is set far above, so the bytes are what binds.)"""
    topic = new_topic(partitions=1)
    sent = produce(topic, (b"x" * VALUE_BYTES for _ in range(1500)), partition=0)
    # Each batch outlasts the fetch after a resume: with 0.3 s batches, confluent's batches were once
    # seen a whole second apart (a resumed partition fetched again about 0.7 s later), so the queues
    # were full only between that fetch and the next batch taking them, and no scrape saw them full.
    w = workers(pg_dsn, topic, f"metrics-buffered-{topic}", args=["--metrics-port", "0", "--max-batch-size", "1000"],
                env={"KSTORE_MAX_BUFFERED_BYTES": str(MAX_BUFFERED), "KSTORE_MAX_POLL_RECORDS": str(POLL_RECORDS),
                     "KSTORE_TEST_BATCH_SLEEP": "1.5"})
    port = port_of(w)
    seen_bytes: list[float] = []
    seen_records: list[float] = []
    paused: list[float] = []
    # The worker's join and claim come first, slow on a loaded machine; then, until the queues
    # reached the bound, fetching paused and resumed after it, and a few seconds more of draining.
    w.wait_for_log(rf"claimed {re.escape(topic)}\[0\]", timeout=120)
    deadline = time.monotonic() + 90
    settled: float | None = None
    while time.monotonic() < (deadline if settled is None else min(deadline, settled)):
        s = scrape(port)
        seen_bytes.append(total(s, "kstore_buffered_bytes"))
        seen_records.append(total(s, "kstore_buffered_records"))
        paused.append(total(s, "kstore_fetch_paused"))
        if settled is None and max(seen_bytes) >= MAX_BUFFERED and 1.0 in paused and paused[-1] == 0.0:
            settled = time.monotonic() + 3
        time.sleep(0.05)
    one_fetch = POLL_RECORDS * (VALUE_BYTES + RECORD_OVERHEAD)
    assert max(seen_bytes) >= MAX_BUFFERED, "the bound was never reached: the test shows nothing"
    assert max(seen_bytes) <= MAX_BUFFERED + one_fetch, (max(seen_bytes), MAX_BUFFERED + one_fetch)
    assert 1.0 in paused and 0.0 in paused
    assert max(seen_records) <= (MAX_BUFFERED + one_fetch) // VALUE_BYTES
    assert w.terminate() == 0
    counts = effects(pg_dsn)
    stored = stored_offsets(pg_dsn, f"metrics-buffered-{topic}")[(topic, 0)]
    assert stored > 0
    assert_exactly_once(counts, {m for m in sent if m[2] < stored})


def documented(prefix: str) -> set[str]:
    """The metrics docs/observability.md names that start with ``prefix``."""
    return set(re.findall(rf"`({re.escape(prefix)}[a-z_]+)", (REPO_DIR / "docs" / "observability.md").read_text()))


def test_every_documented_outbox_metric_is_on_a_producing_workers_metrics_its_relays_backlog_too(
    pg_dsn: str, new_topic: Callable[..., str], produce: Callable[..., Any], workers: Callable[..., Any],
) -> None:
    """A worker whose processor produces, and publishes what it produced through its own relay: every
    ``kstore_outbox_*`` metric the docs name is on its /metrics, and its relay's backlog, named by the
    outbox (the group), falls to 0 once all is published."""
    source, out, group = new_topic(partitions=1), new_topic(partitions=1), "metrics-outbox"
    engine = sa.create_engine(pg_dsn)
    booker_tables.create_all(engine)
    engine.dispose()
    sent = produce(source, (f"k{i % 3}:{i}" for i in range(20)), partition=0)
    w = workers(pg_dsn, source, group, "outbox_processors:Booker", env={"KSTORE_TEST_OUT_TOPIC": out},
                args=["--metrics-port", "0"])
    port = port_of(w)
    records = sum(copies(offset) for _, _, offset in sent)
    wait_until(lambda: total(scrape(port), "kstore_outbox_published_total", group=group) == records, 90,
               what="every produced record published")
    s = wait_until(lambda: (lambda s: s if total(s, "kstore_outbox_records_waiting", outbox=group) == 0 else None)(
        scrape(port)), 30, what="the relay's backlog at 0")
    names = {name for name, _ in s}
    wanted = documented("kstore_outbox_")
    assert {"kstore_outbox_records_waiting", "kstore_outbox_oldest_record_age_seconds"} <= wanted
    assert sorted(n for n in wanted if n not in names and f"{n}_count" not in names) == [], "documented, not served"
    assert total(s, "kstore_outbox_oldest_record_age_seconds", outbox=group) == 0
    assert w.terminate() == 0
