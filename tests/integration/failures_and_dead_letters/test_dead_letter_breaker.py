"""The dead-letter breaker: a processor that fails on every message stops the worker (or pauses it,
unready) after ``max_consecutive_dead_letters`` messages in a row were dead-lettered, instead of
dead-lettering the whole topic while /readyz says healthy. Rejections count apart, against
``max_consecutive_rejects``; any handled message ends both runs."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from typing import Any

import sqlalchemy as sa

from kstore.engine.failures import Breaker
from kstore.retry import Failure, Reject
from tests.support.harness import stored_offsets, wait_until


class Rec:
    def __init__(self, offset: int, partition: int = 0) -> None:
        self.topic, self.partition, self.offset = "t", partition, offset


def letter(record: Rec, final: bool) -> tuple[Any, Failure]:
    failure = Failure(final=final)
    failure.record(Reject("no") if final else KeyError("x"))
    return record, failure


def test_the_breaker_counts_runs_of_dead_letters_by_kind_and_any_handled_message_ends_them() -> None:
    breaker = Breaker(max_crashes=3, max_rejects=5)
    recs = [Rec(i) for i in range(20)]
    assert breaker.committed(recs[0:1], [letter(recs[0], False)]) is None
    assert breaker.committed(recs[1:2], [letter(recs[1], False)]) is None
    # A batch whose last message was handled: the run starts again.
    assert breaker.committed(recs[2:4], [letter(recs[2], False)]) is None and breaker.runs["crashed"] == 0
    # Rejections do not count as crashes, nor end their run.
    assert breaker.committed(recs[4:5], [letter(recs[4], False)]) is None
    assert breaker.committed(recs[5:9], [letter(r, True) for r in recs[5:9]]) is None
    assert breaker.committed(recs[9:10], [letter(recs[9], False)]) is None
    why = breaker.committed(recs[10:11], [letter(recs[10], False)])
    assert why is not None and why.startswith("3 messages in a row failed every attempt"), why
    assert "(max_consecutive_dead_letters=3); the last: t[0] offset 10: KeyError: 'x'" in why, why

    rejects = Breaker(max_crashes=3, max_rejects=5)
    # Letters after the batch's last handled message continue into the next batch.
    assert rejects.committed(recs[0:4], [letter(recs[0], True), letter(recs[2], True), letter(recs[3], True)]) is None
    assert rejects.runs == {"crashed": 0, "rejected": 2}
    why = rejects.committed(recs[4:7], [letter(r, True) for r in recs[4:7]])
    assert why is not None and "5 messages in a row were rejected" in why and "max_consecutive_rejects=5" in why
    assert rejects.committed(recs[7:8], []) is None and rejects.runs == {"crashed": 0, "rejected": 0}

    off = Breaker(max_crashes=0, max_rejects=0)
    assert all(off.committed([r], [letter(r, False)]) is None for r in recs)


def dead_letter_count(dsn: str, group: str) -> int:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM kstore_dead_letters WHERE consumer_group = :g"),
                                    {"g": group}).scalar_one())
    finally:
        engine.dispose()


def test_a_processor_failing_on_every_message_stops_the_worker_after_the_limit(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(partitions=1), "broken"
    produce(topic, ["poison"] * 200)
    w = workers(pg_dsn, topic, group, env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "1", "--max-consecutive-dead-letters", "5"])
    assert w.wait(120) == 1
    assert dead_letter_count(pg_dsn, group) == 5
    assert stored_offsets(pg_dsn, group) == {(topic, 0): 5}, "the five letters committed, nothing after them"
    (line,) = [ln for ln in w.log.splitlines() if ln.startswith("kstore: error:")]
    assert line.startswith("kstore: error: 5 messages in a row failed every attempt and were dead-lettered, none "
                           "handled in between (max_consecutive_dead_letters=5); the last: "
                           f"{topic}[0] offset 4: ValueError: poison message"), line
    assert "the worker stops (dead_letter_breaker=stop)" in line and "Traceback" not in w.log


def test_rejections_count_against_their_own_limit(pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(partitions=1), "all-rejected"
    produce(topic, [f"bad{i}" for i in range(300)])
    w = workers(pg_dsn, topic, group, processor="processors:Validating",
                args=["--on-error", "dead_letter", "--max-consecutive-dead-letters", "5",
                      "--max-consecutive-rejects", "50", "--max-batch-size", "20"])
    assert w.wait(120) == 1
    # Rejected in their batches' transactions: the batch that reached 50 committed whole, then the worker stopped.
    assert 50 <= dead_letter_count(pg_dsn, group) < 70
    assert re.search(r"kstore: error: \d+ messages in a row were rejected .*\(max_consecutive_rejects=50\); "
                     r"the last: .* Reject: invalid value 'bad\d+'", w.log), w.log[-2000:]


def test_with_pause_the_worker_stays_in_the_group_unready_and_dead_letters_no_more(
        pg_dsn: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(partitions=1), "paused"
    produce(topic, ["poison"] * 100)
    w = workers(pg_dsn, topic, group, env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "1", "--max-consecutive-dead-letters", "3",
                      "--dead-letter-breaker", "pause", "--metrics-port", "0"])
    w.wait_for_log(r"serving /metrics, /livez and /readyz on http://[\d.]+:\d+")
    port = int(re.findall(r"serving /metrics, /livez and /readyz on http://[\d.]+:(\d+)", w.log)[0])
    w.wait_for_log(r"dead-letter breaker: .*; paused: no more batches until the worker is restarted")

    def probe(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def unready() -> str | None:
        status, body = probe("/readyz")
        return body if status == 503 else None

    body = wait_until(unready, 30, what="/readyz to turn unready")
    assert "paused by the dead-letter breaker: 3 messages in a row failed every attempt" in body, body
    assert probe("/livez")[0] == 200, "paused is not dead: no restart wanted"
    assert dead_letter_count(pg_dsn, group) == 3 and stored_offsets(pg_dsn, group) == {(topic, 0): 3}
    assert w.proc.poll() is None, "still running, in the group"
    assert w.terminate() == 0
    assert dead_letter_count(pg_dsn, group) == 3, "no batch was taken after the pause"
