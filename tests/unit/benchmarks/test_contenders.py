"""The side-by-side benchmark's contenders and ratios hang together (no broker, no database)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.contenders import CEILINGS, CONTENDERS, LATENCY_JUDGED, RATIOS, select
from benchmarks.report import table
from benchmarks.runner import Options, Runner
from benchmarks.sweep import variants
from kstore import Settings

BY_NUMBER = {c.number: c for c in CONTENDERS}
DSN = "postgresql+psycopg2://bench@127.0.0.1:1/bench"


def test_every_ratio_names_contenders_that_exist() -> None:
    assert len({c.number for c in CONTENDERS}) == len(CONTENDERS)
    assert len({c.name for c in CONTENDERS}) == len(CONTENDERS)
    for r in RATIOS:
        assert r.numerator in BY_NUMBER and r.denominator in BY_NUMBER, r.key
    assert len({r.key for r in RATIOS}) == len(RATIOS)


def test_a_kstore_contender_with_a_target_is_judged_against_a_loop_on_its_own_client() -> None:
    """Per client: kstore against the hand-written loop, or the no-op against the raw loop, on the same client."""
    judged = [r for r in RATIOS if r.target is not None and not BY_NUMBER[r.denominator].kstore]
    assert judged
    for r in judged:
        assert BY_NUMBER[r.numerator].client == BY_NUMBER[r.denominator].client, r.key
    for baseline, numbers in LATENCY_JUDGED.items():
        assert {BY_NUMBER[n].client for n in numbers} == {BY_NUMBER[baseline].client}
    assert {BY_NUMBER[n].client for n in CEILINGS.values()} == set(CEILINGS)


def test_the_headline_loops_are_tuned_and_their_defaults_kept_as_references() -> None:
    for number in (1, 2, 11, 12, 19, 20):
        assert BY_NUMBER[number].tuning, number
    assert not BY_NUMBER[26].tuning and BY_NUMBER[26].entry == BY_NUMBER[1].entry
    assert not BY_NUMBER[27].tuning and BY_NUMBER[27].entry == BY_NUMBER[12].entry
    assert not BY_NUMBER[3].tuning  # the obvious code, as a user writes it today


@pytest.mark.parametrize("environ_client", ["kafka-python", "confluent"])
def test_a_kstore_contender_runs_on_the_client_it_names(
    environ_client: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its settings travel in the child's config to ``Settings.from_env`` (kstore_loop), over any
    ``KSTORE_KAFKA_CLIENT``."""
    monkeypatch.setenv("KSTORE_KAFKA_CLIENT", environ_client)
    runner = Runner(Options(out=tmp_path), "127.0.0.1:1", DSN, [])
    try:
        for c in CONTENDERS:
            if not c.kstore:
                continue
            config = runner._config(c, "throughput", "topic", 10, "tag")
            settings = Settings.from_env(dsn=DSN, **config["kstore_settings"])
            assert settings.kafka_client == c.client, c.name
            for name, value in c.settings.items():
                assert getattr(settings, name) == value, (c.name, name)
    finally:
        runner.engine.dispose()
    assert {c.name for c in CONTENDERS if c.kstore and c.client == "confluent"} >= {
        "kstore-noop-confluent", "kstore-handle-confluent", "kstore-batch-confluent", "kstore-text-confluent",
        "kstore-copy-confluent"}


def test_the_sweep_tries_every_combination_once() -> None:
    runs = variants(select("12,19,1"), [1000, 2000], [100, 0])
    assert [c.name for c in runs] == [
        "kafka-python-b1000", "kafka-python-b2000",
        "exactly-once-by-hand-b1000-p100", "exactly-once-by-hand-b1000-p0",
        "exactly-once-by-hand-b2000-p100", "exactly-once-by-hand-b2000-p0",
        "exactly-once-by-hand-confluent-b1000-p100", "exactly-once-by-hand-confluent-b1000-p0",
        "exactly-once-by-hand-confluent-b2000-p100", "exactly-once-by-hand-confluent-b2000-p0",
    ]
    assert runs[0].tuning == {"max_poll_records": 1000}
    assert runs[-1].tuning == {"consume_batch": 2000, "page_size": 0}


def test_the_sweep_tries_librdkafkas_fetch_backoff_on_confluent_loops_only() -> None:
    runs = variants(select("2,1"), [1000], [100], [1000, 100])
    assert [(c.name, c.tuning) for c in runs] == [
        ("kafka-python-b1000", {"max_poll_records": 1000}),
        ("confluent-kafka-b1000-q1000", {"consume_batch": 1000, "fetch_queue_backoff_ms": 1000}),
        ("confluent-kafka-b1000-q100", {"consume_batch": 1000, "fetch_queue_backoff_ms": 100}),
    ]


def test_the_table_names_both_ceilings_and_groups_the_ratios_by_client() -> None:
    def ran(number: int, throughput: float) -> dict[str, object]:
        c = BY_NUMBER[number]
        return {"number": number, "name": c.name, "label": c.label, "messages": 1000,
                "throughput_msgs_per_s": throughput, "peak_rss_mb": 100.0, "cpu_s": 1.0,
                "exactly_once": {"passed": True},
                "latency": {"rate": 1000.0, "p50_ms": 1.0, "p99_ms": 2.0}}

    from benchmarks import report

    done = [ran(1, 200_000.0), ran(2, 250_000.0), ran(12, 80_000.0), ran(19, 90_000.0), ran(25, 180_000.0),
            ran(14, 150_000.0)]
    text = table({"contenders": done, "ratios": report.ratios(done), "ceilings": report.ceilings(done)})
    assert "ceilings (raw loops, reading only): kafka-python 200,000 msg/s; confluent 250,000 msg/s" in text
    lines = text.splitlines()
    confluent = next(i for i, line in enumerate(lines) if line.startswith(" confluent-kafka:"))
    assert "25/19" in lines[confluent + 1] and "2.00" in lines[confluent + 1]
    assert any("25/14" in line and "1.20" in line and "NOT MET" in line for line in lines)


def test_an_effects_table_and_its_offsets_table_keep_apart_within_postgresqls_63_bytes() -> None:
    from benchmarks.runner import table_name

    names = set()
    for c in CONTENDERS:
        for phase in ("throughput", "latency"):
            for suffix in ("", "-again1", "-sweep0"):
                table = table_name("0123abcd", f"{c.number}-{c.name}-b5000-p1000-{phase}{suffix}")
                assert len(table + "_offsets") <= 63
                names.add(table)
    assert len(names) == len(CONTENDERS) * 6
    assert table_name("0123abcd", "12-exactly-once-by-hand-latency") == "bench_0123abcd_12_exactly_once_by_hand_latency"


def test_repeated_latency_phases_report_the_one_with_the_median_p99_and_judge_on_it() -> None:
    """Three phases: the reported one is the median-p99 phase itself (its p50 with it), every phase's
    p99 is kept in run order, one phase that fell behind marks the whole, and the p99 target compares medians."""
    from benchmarks import report
    from benchmarks.runner import median_phase

    def phase(p50: float, p99: float, kept_up: bool = True) -> dict[str, object]:
        return {"rate": 1000.0, "p50_ms": p50, "p99_ms": p99, "kept_up": kept_up}

    one = phase(5.0, 40.0)
    assert median_phase([one]) is one
    chosen = median_phase([phase(5.0, 90.0), phase(6.0, 20.0), phase(7.0, 30.0)])
    assert (chosen["p50_ms"], chosen["p99_ms"]) == (7.0, 30.0)
    assert chosen["p99_ms_each"] == [90.0, 20.0, 30.0] and chosen["p50_ms_each"] == [5.0, 6.0, 7.0]
    assert chosen["kept_up"] is True
    assert median_phase([phase(5.0, 10.0), phase(5.0, 20.0, kept_up=False)])["p99_ms"] == 10.0
    assert median_phase([phase(5.0, 10.0), phase(5.0, 20.0, kept_up=False)])["kept_up"] is False

    def ran(number: int, phases: list[dict[str, object]]) -> dict[str, object]:
        c = BY_NUMBER[number]
        return {"number": number, "name": c.name, "label": c.label, "messages": 1000,
                "throughput_msgs_per_s": 50_000.0, "peak_rss_mb": 100.0, "cpu_s": 1.0,
                "exactly_once": {"passed": True}, "latency": median_phase(phases)}

    # kstore's worst phase is worse than the loop's worst, but its median is not: met.
    done = [ran(12, [phase(5.0, 30.0), phase(5.0, 25.0), phase(5.0, 35.0)]),
            ran(5, [phase(5.0, 80.0), phase(5.0, 22.0), phase(5.0, 28.0)])]
    judged = report.latency_target(done)
    assert [(t["contender"], t["p99_ms"], t["baseline_p99_ms"], t["met"]) for t in judged] == [
        ("kstore-handle", 28.0, 30.0, True)]
    text = table({"contenders": done, "ratios": report.ratios(done), "ceilings": report.ceilings(done),
                  "latency_target": judged})
    assert "(medians of 80.0/22.0/28.0 and 30.0/25.0/35.0)" in text


def test_repeated_drains_report_the_one_with_the_median_throughput_and_keep_every_run() -> None:
    from benchmarks.runner import median_drain

    def drain(throughput: float) -> dict[str, object]:
        return {"throughput_msgs_per_s": throughput, "seconds": 1_000_000 / throughput}

    one = drain(100.0)
    assert median_drain([one]) is one
    chosen = median_drain([drain(300.0), drain(100.0), drain(200.0)])
    assert chosen["throughput_msgs_per_s"] == 200.0 and chosen["seconds"] == 5000.0
    assert chosen["throughput_each"] == [300.0, 100.0, 200.0]
    assert median_drain([drain(300.0), drain(100.0)])["throughput_msgs_per_s"] == 100.0


def test_a_ratio_not_met_says_how_high_the_runs_cpu_lets_it_go_on_this_machine() -> None:
    """25 drained 1,000 messages with 4 CPU seconds of the whole run: on 2 cores at most 500 msg/s,
    so against 28's 1,000 msg/s at most 0.50, which the table prints beside the unmet 0.85."""
    from benchmarks import report

    def ran(number: int, throughput: float, run_cpu_s: float) -> dict[str, object]:
        c = BY_NUMBER[number]
        return {"number": number, "name": c.name, "label": c.label, "messages": 1000,
                "throughput_msgs_per_s": throughput, "seconds": 1000 / throughput, "peak_rss_mb": 100.0,
                "cpu_s": 1.0, "exactly_once": {"passed": True}, "latency": None, "run_cpu_s": run_cpu_s}

    done = [ran(28, 1000.0, 1.0), ran(25, 400.0, 4.0), ran(19, 100.0, 2.0)]
    by_key = {r["ratio"]: r for r in report.ratios(done, cores=2)}
    assert by_key["25/28"]["cpu_bound"] == 0.5 and by_key["25/28"]["met"] is False
    assert by_key["25/19"]["met"] is True
    assert report.cpu_ceiling(done[1], 2) == 500.0
    assert "cpu_bound" not in report.ratios(done)[0]  # the cores not given: no bound
    text = table({"contenders": done, "ratios": list(by_key.values()), "ceilings": []})
    line = next(line for line in text.splitlines() if "25/28" in line)
    assert "NOT MET" in line and "allows at most 0.50" in line
    assert "allows at most" not in next(line for line in text.splitlines() if "25/19" in line)
    assert " 1.60 " in next(line for line in text.splitlines() if line.startswith("25 "))  # 4 CPU s in 2.5 s


def test_the_table_says_where_a_kstore_workers_main_thread_spent_its_drain() -> None:
    """25 drained 1,000 messages in 2.5 s, 2.0 s of it inside its 4 batches, 0.5 s of those
    committing: 80% in batches (60% handler and writes, 20% offsets and COMMIT), 20% waiting."""
    from benchmarks import report

    c = BY_NUMBER[25]
    ran = {"number": 25, "name": c.name, "label": c.label, "messages": 1000, "throughput_msgs_per_s": 400.0,
           "seconds": 2.5, "peak_rss_mb": 100.0, "cpu_s": 1.0, "exactly_once": {"passed": True}, "latency": None,
           "main_thread": {"batches": 4, "in_batches_s": 2.0, "committing_s": 0.5}}
    raw = dict(ran, number=2, name=BY_NUMBER[2].name)
    del raw["main_thread"]  # a loop that is not a kstore worker records none
    lines = report.main_threads([raw, ran])
    assert lines[1] == "where each kstore worker's main thread spent the drain" and len(lines) == 3
    assert lines[2].split() == ["25", c.name, "in", "batches", "80%", "of", "the", "drain", "(handler", "and",
                                "writes", "60%,", "offsets", "and", "COMMIT", "20%),", "waiting", "for", "records",
                                "20%;", "4", "batches", "of", "250", "on", "average"]
    assert report.main_threads([raw]) == []
