"""Commits in doubt and silent databases, against real Kafka and a real PostgreSQL
behind the fault-injecting proxy (tests/support/faultproxy.py).

A COMMIT whose answer is lost may have landed. Each test here cuts the
connection at exactly that byte (the server has committed, the worker never
hears it) or makes the database go silent, and checks that every effect lands
exactly once and that the worker says what happened.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import kstore.engine.worker
from kstore import Message, Settings, Worker
from kstore.db.store import make_engine
from kstore.relay.store import Outbox
from tests.conftest import KAFKA_CLIENT
from tests.support.faultproxy import FaultProxy
from tests.support.harness import (
    assert_exactly_once,
    effects,
    outbox_rows,
    read_committed_records,
    stored_offsets,
    wait_until,
    with_driver,
)
from tests.support.lossy import Faults, lossy_engine
from tests.support.processors import Recorder

pytestmark = pytest.mark.integration

#: What a worker logs when the database goes silent: a round trip cut at its deadline, or a
#: new connection that got no answer within the connect timeout (the same deadline).
SILENCE_NOTICED = (r"database round trip got no answer within its deadline|failed: timeout expired"
                   r"|connection timeout expired")  # the last: psycopg 3's words for a connect timeout


#: psycopg2 and psycopg 3: the commit-in-doubt and silent-database paths on both drivers.
DRIVERS = ["psycopg2", "psycopg"]


@pytest.fixture
def pg_proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    url = make_url(pg_dsn)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy
    print("--- the proxy's last events ---\n" + "\n".join(proxy.events[-150:]))  # shown when the test failed


def dead_letters(dsn: str) -> list[Any]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text('SELECT topic, partition_id, "offset" FROM kstore_dead_letters')))
    finally:
        engine.dispose()


@pytest.mark.parametrize(("driver", "write"), [(d, w) for w in ("insert", "copy", "text") for d in DRIVERS])
def test_batch_commits_in_doubt_land_exactly_once(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                  produce: Any, workers: Any, driver: str, write: str) -> None:
    """Cut COMMITs of the worker's batches land exactly once (without the read-back, 6 cut COMMITs
    made 800 duplicate effects). On both drivers, and for each way the rows go in: a Core INSERT,
    COPY (session.copy_rows) and text() INSERTs deferred by the session (kstore's multi-row
    statements, kstore/db/manyrows.py)."""
    topic = new_topic(4)
    expected = set(produce(topic, [f"m{i}" for i in range(1500)]))
    # No relay: its lease rounds commit too, and the COMMIT cut must be a batch's.
    w = workers(with_driver(pg_proxy.dsn_through(pg_dsn), driver), topic, "indoubt",
                env={"KSTORE_MAX_BATCH_SIZE": "100", "KSTORE_TEST_BATCH_SLEEP": "0.01", "KSTORE_TEST_WRITE": write,
                     "KSTORE_RELAY": "false"})
    w.wait_for_log(r"claimed ")
    for n in range(1, 7):
        pg_proxy.cut_after_commit()
        # Produced after arming, so a COMMIT is still to come however fast the backlog went.
        expected |= set(produce(topic, [f"m{n}-{i}" for i in range(250)]))
        wait_until(lambda n=n: pg_proxy.commits_cut >= n, 60, what=f"commit cut {n}")
        # Armed again only once the worker has settled this one: the read-back that settles it
        # commits too, and a cut of that COMMIT would be a cut of no batch's.
        wait_until(lambda n=n: w.log.count("lost its answer") >= n, 60, what=f"commit {n} settled")
    stopped_with_every_effect_once(w, pg_dsn, expected)
    assert w.log.count("lost its answer") >= 6, w.log[-3000:]
    assert "but landed: not processing it again" in w.log
    assert sum(stored_offsets(pg_dsn, "indoubt").values()) == len(expected)
    if driver == "psycopg2":  # there the offsets' compare-and-set and COMMIT are one message (kstore/db/store.py)
        cut = [e for e in pg_proxy.events if "cut after COMMIT (after the statements before it" in e]
        assert len(cut) >= 6, pg_proxy.events[-20:]
    # The cuts hit batches written the way this case is about (not only claims or other bookkeeping).
    batches = [t for t in pg_proxy.cut_transactions if wrote_effects(t, write)]
    assert len(batches) >= 6, pg_proxy.cut_transactions


@pytest.mark.parametrize("driver", DRIVERS)
def test_batch_commits_that_never_reached_the_server_are_processed_again_once(
        pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any, produce: Any, workers: Any, driver: str) -> None:
    """The other half of a lost COMMIT answer: the COMMIT never reached the server, which rolled the
    batch back. The worker reads the rows back, finds them at the batch's start ("did not land"),
    processes the batch again, and every effect lands once."""
    topic = new_topic(2)
    expected = set(produce(topic, [f"m{i}" for i in range(300)]))
    w = workers(with_driver(pg_proxy.dsn_through(pg_dsn), driver), topic, "refused",
                env={"KSTORE_MAX_BATCH_SIZE": "50", "KSTORE_TEST_BATCH_SLEEP": "0.01"})
    w.wait_for_log(r"claimed ")
    # Armed one at a time until three refusals took batches' COMMITs (another may take a claim's).
    n = 0
    while len(refused_batches(pg_proxy)) < 3:
        n += 1
        assert n <= 10, pg_proxy.refused_transactions
        pg_proxy.cut_before_commit()
        expected |= set(produce(topic, [f"m{n}-{i}" for i in range(100)]))
        wait_until(lambda n=n: pg_proxy.commits_refused >= n, 60, what=f"commit refused {n}")
    stopped_with_every_effect_once(w, pg_dsn, expected)
    assert sum(stored_offsets(pg_dsn, "refused").values()) == len(expected)
    # Each batch whose COMMIT was refused (its effects rolled back) was processed again, and the worker said so.
    assert w.log.count("did not land: processing it again") >= len(refused_batches(pg_proxy)), w.log[-3000:]


def refused_batches(proxy: FaultProxy) -> list[list[str]]:
    """The transactions whose COMMIT the proxy refused that wrote effects: batches'."""
    return [t for t in proxy.refused_transactions if wrote_effects(t, "insert")]


def stopped_with_every_effect_once(w: Any, dsn: str, expected: set[tuple[str, int, int]]) -> None:
    """Once every expected effect is there (and a moment more: a duplicate would come right after a
    resolution), the worker stops cleanly, and each expected message has exactly one effect."""
    wait_until(lambda: len(effects(dsn)) >= len(expected), 90, what="every message processed")
    time.sleep(1)
    assert w.terminate() == 0
    assert_exactly_once(effects(dsn), expected)


def wrote_effects(transaction: list[str], write: str) -> bool:
    """Whether a transaction the proxy saw wrote effects rows ``write``'s way: for "copy", a
    ``COPY effects ... FROM STDIN`` with its data; otherwise INSERTs."""
    statements = [sql.strip().upper() for sql in transaction]
    if write == "copy":
        return any(re.search(r"(^|;\s*)COPY EFFECTS\b", s) for s in statements) and "<COPYDATA>" in statements
    return any(re.search(r"(^|;\s*)INSERT INTO EFFECTS\b", s) for s in statements)


def test_dead_letter_commit_in_doubt_writes_one_dead_letter(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                            produce: Any, workers: Any) -> None:
    """The dead letter's COMMIT loses its answer: still one dead letter, and the offset moves past it once."""
    topic = new_topic(1)
    before = set(produce(topic, [f"ok{i}" for i in range(50)]))
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "indoubt-dl", env={"KSTORE_TEST_FAIL_VALUE": "poison"},
                args=["--on-error", "dead_letter", "--max-attempts", "1"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(before), 60, what="the first messages")
    # Failed attempts roll back; the next COMMIT that writes a dead letter is the poison's (the relay's
    # own commits, asking for a wake-up, go through the proxy too).
    pg_proxy.cut_after_commit(touching="kstore_dead_letters")
    (poison,) = produce(topic, ["poison"])
    wait_until(lambda: pg_proxy.commits_cut >= 1, 60, what="the dead letter's commit cut")
    after = set(produce(topic, [f"late{i}" for i in range(20)]))
    wait_until(lambda: len(effects(pg_dsn)) >= len(before) + len(after), 60, what="the messages after the poison")
    assert w.terminate() == 0
    assert [tuple(r) for r in dead_letters(pg_dsn)] == [poison]
    assert_exactly_once(effects(pg_dsn), before | after)
    assert stored_offsets(pg_dsn, "indoubt-dl") == {(topic, 0): poison[2] + 21}
    assert "the COMMIT of a dead letter" in w.log


def test_dead_letters_whose_commit_answers_are_lost_reach_their_topic_once(
        pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any, produce: Any, workers: Any, kafka: str) -> None:
    """A letter's record for the dead-letter topic is written to the outbox in the letter's own
    transaction: three such COMMITs lose their answers (they landed), and each letter is still in the
    database once and on the topic once."""
    topic, dlt = new_topic(2), new_topic(1)
    values = [json.dumps({"n": n, "kind": "crash" if n % 10 == 3 else "ok"}).encode() for n in range(300)]
    pg_proxy.cut_after_commit(count=3, touching="kstore_dead_letters")
    sent = produce(topic, values)
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "lettered", "letter_processors:Lettered",
                env={"KSTORE_TEST_DLT_TOPIC": dlt}, args=["--max-batch-size", "50"])
    bad = {sent[i] for i, v in enumerate(values) if b'"crash"' in v}
    wait_until(lambda: pg_proxy.commits_cut >= 3, 120, what="three letters' COMMIT answers cut")
    ends: dict[tuple[str, int], int] = {}
    for t, p, o in sent:
        ends[(t, p)] = max(ends.get((t, p), 0), o + 1)
    wait_until(lambda: all((stored_offsets(pg_dsn, "lettered").get(tp) or 0) >= e for tp, e in ends.items()),
               120, interval=0.5, what="every message committed")
    wait_until(lambda: outbox_rows(pg_dsn) == 0, 60, interval=0.5, what="every letter's record published")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), set(sent) - bad)
    assert sorted(tuple(r) for r in dead_letters(pg_dsn)) == sorted(bad)
    on_topic = Counter((h["kafka_dlt-original-topic"].decode(),
                        int.from_bytes(h["kafka_dlt-original-partition"], "big", signed=True),
                        int.from_bytes(h["kafka_dlt-original-offset"], "big", signed=True))
                       for h in (dict(r.headers) for r in read_committed_records(kafka, dlt)))
    assert set(on_topic) == bad and set(on_topic.values()) == {1}, "each letter on its topic once"


def test_claim_in_doubt_delivers_nothing_until_a_claim_is_known(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                                produce: Any, workers: Any) -> None:
    """A worker's first COMMIT on the offsets table is its claim (and where each partition starts): cut
    it. Nothing may be delivered under that claim; the worker claims again and everything lands once.
    (The group's outbox shards exist already and its relay is off.)"""
    topic = new_topic(2)
    expected = set(produce(topic, [f"c{i}" for i in range(200)]))
    engine = make_engine(Settings(dsn=pg_dsn))
    Outbox(engine, "indoubt-claim").ensure_shards(4)
    engine.dispose()
    pg_proxy.cut_after_commit(touching="kstore_offsets")
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "indoubt-claim", args=["--no-relay"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 60, what="every message processed")
    assert w.terminate() == 0
    assert pg_proxy.commits_cut == 1
    assert_exactly_once(effects(pg_dsn), expected)
    log = w.log
    failed_claim = log.index("could not claim")
    assert not re.search(r"committed \d+ messages", log[:failed_claim]), "a batch ran under an unanswered claim"
    assert log.index("claimed ") > failed_claim


def test_a_registration_whose_commit_answer_was_lost_is_made_again(pg_dsn: str, pg_proxy: FaultProxy,
                                                                   new_topic: Any, produce: Any, workers: Any) -> None:
    """The worker's row in its database's registry of the group's workers is written before it joins:
    a COMMIT whose answer was lost there is written again (it is safe to), not the end of the start."""
    topic = new_topic(2)
    expected = set(produce(topic, [f"r{i}" for i in range(50)]))
    pg_proxy.cut_after_commit(touching="kstore_group_members")
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, "indoubt-register", args=["--no-relay"])
    wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 60, what="every message processed")
    assert w.terminate() == 0
    assert pg_proxy.commits_cut == 1
    assert "could not register this worker with its database" in w.log
    assert_exactly_once(effects(pg_dsn), expected)


@pytest.mark.parametrize(("driver", "write"), [(d, w) for w in ("insert", "copy") for d in DRIVERS])
def test_a_silent_database_is_detected_within_the_deadline(pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any,
                                                           produce: Any, workers: Any, driver: str,
                                                           write: str) -> None:
    """A blackhole (nothing forwarded, nothing closed) must not hang the worker: each round trip
    has KSTORE_DB_TIMEOUT_S, after which the connection is cut and the work resolved. A COPY
    (session.copy_rows) is such a round trip too."""
    topic = new_topic(2)
    first = set(produce(topic, [f"a{i}" for i in range(100)]))
    w = workers(with_driver(pg_proxy.dsn_through(pg_dsn), driver), topic, "silent",
                env={"KSTORE_DB_TIMEOUT_S": "3", "KSTORE_TEST_WRITE": write})
    wait_until(lambda: len(effects(pg_dsn)) >= len(first), 60, what="the first messages")
    pg_proxy.blackhole_for(15)
    started = time.monotonic()
    second = set(produce(topic, [f"b{i}" for i in range(100)]))
    w.wait_for_log(SILENCE_NOTICED, timeout=30)
    detected = time.monotonic() - started
    # Without the deadline nothing would be noticed before the blackhole ends, 15 s on.
    assert detected < 12, f"detected after {detected:.1f}s with a 3s deadline"
    wait_until(lambda: len(effects(pg_dsn)) >= len(first | second), 60, what="processing after the partition")
    assert w.terminate() == 0
    assert_exactly_once(effects(pg_dsn), first | second)


def history_moves(dsn: str, group: str) -> list[tuple[str, int, int, int]]:
    """Operator resets of a group: (topic, partition, from, to)."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(
                "SELECT topic, partition_id, from_offset, to_offset FROM kstore_offset_history "
                "WHERE consumer_group = :g AND reason LIKE 'kstore offsets set%' ORDER BY id"), {"g": group})]
    finally:
        engine.dispose()


def expected_counts(sent: set[tuple[str, int, int]],
                    moves: list[tuple[str, int, int, int]]) -> Counter[tuple[str, int, int]]:
    """How many effects each message must have: once, plus once more for every backward
    reset whose range covers it (a replay the operator asked for)."""
    counts = Counter({key: 1 for key in sent})
    for topic, partition, start, end in ((t, p, to, frm) for t, p, frm, to in moves):
        assert start <= end, "the test only shifts backwards"
        for offset in range(start, end):
            counts[(topic, partition, offset)] += 1
    return counts


@pytest.mark.long
def test_exactly_once_through_cut_commits_blackholes_poison_and_online_resets(
        kafka: str, pg_dsn: str, pg_proxy: FaultProxy, new_topic: Any, produce: Any, workers: Any) -> None:
    """Everything at once, against the real broker and PostgreSQL behind the proxy: 6 COMMITs
    whose answers are lost, two 30 s blackholes, a poison message at the head of one partition
    while another has a backlog, and `kstore offsets set --shift-by` replays while it runs.
    Every message's effect lands exactly as often as the stored offsets say (once, plus once per
    replay the operator asked for), the poison is dead-lettered once, and the worker notices each
    silence within its deadline and carries on."""
    topic, group = new_topic(4), "everything"
    sent = set(produce(topic, [f"backlog{i}" for i in range(2500)], partition=0))
    (poison,) = produce(topic, ["poison"], partition=3)
    sent |= set(produce(topic, [f"spread{i}" for i in range(1200)]))
    w = workers(pg_proxy.dsn_through(pg_dsn), topic, group,
                env={"KSTORE_TEST_FAIL_VALUE": "poison", "KSTORE_DB_TIMEOUT_S": "5", "KSTORE_MAX_BATCH_SIZE": "200",
                     "KSTORE_TEST_BATCH_SLEEP": "0.02"},
                args=["--on-error", "dead_letter", "--max-attempts", "2"])
    w.wait_for_log(r"claimed ")

    def cut_commits(n: int) -> None:
        for _ in range(n):
            target = pg_proxy.commits_cut + 1
            pg_proxy.cut_after_commit()
            # Produced after arming, so a COMMIT is still to come however fast the backlog went.
            sent.update(produce(topic, [f"more{len(sent)}-{i}" for i in range(100)]))
            wait_until(lambda target=target: pg_proxy.commits_cut >= target, 60, what="a COMMIT cut")

    def blackhole() -> None:
        noticed = len(re.findall(SILENCE_NOTICED, w.log))
        pg_proxy.blackhole_for(30)
        started = time.monotonic()
        w.wait_for_log(SILENCE_NOTICED, timeout=20, count=noticed + 1)
        assert time.monotonic() - started < 5 + 5, "a silent database was not noticed within the 5 s deadline"
        sent.update(produce(topic, [f"dark{len(sent)}-{i}" for i in range(300)]))
        time.sleep(max(0.0, started + 30 - time.monotonic()))

    def shift_back(partition: int) -> None:
        r = subprocess.run([sys.executable, "-m", "kstore", "offsets", "set", "--group", group, "--topic", topic,
                            "--partition", str(partition), "--shift-by", "-40", "--clamp", "--dsn", pg_dsn,
                            "--bootstrap-servers", kafka, "--reason", "replay", "--execute"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr

    cut_commits(3)
    shift_back(0)
    blackhole()
    cut_commits(3)
    shift_back(1)
    blackhole()
    shift_back(0)
    sent.update(produce(topic, [f"last{i}" for i in range(200)]))

    ends = {(topic, p): 1 + max(o for t, pp, o in sent | {poison} if pp == p) for p in range(4)}
    wait_until(lambda: stored_offsets(pg_dsn, group) == ends, 180, what="every partition caught up")
    time.sleep(1)
    assert w.terminate() == 0
    assert len(sent) >= 5000 and pg_proxy.commits_cut >= 6
    assert [tuple(r) for r in dead_letters(pg_dsn)] == [poison]
    moves = history_moves(pg_dsn, group)
    assert len(moves) == 3
    counts = effects(pg_dsn)
    expected = expected_counts(sent, moves)
    wrong = {k: (counts.get(k, 0), n) for k, n in expected.items() if counts.get(k, 0) != n}
    extra = set(counts) - set(expected)
    assert not wrong, f"{len(wrong)} messages with the wrong number of effects (got, want): {sorted(wrong.items())[:5]}"
    assert not extra, f"effects of messages never sent: {sorted(extra)[:5]}"


class CountingRecorder(Recorder):
    """The tests' Recorder (one effect per message), counting the messages handed to it."""

    handled = 0

    def handle_batch(self, msgs: Sequence[Message]) -> None:
        self.handled += len(msgs)
        super().handle_batch(msgs)


def test_until_a_lost_commits_rows_can_be_read_nothing_else_is_processed(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """docs/failures.md: after a batch's COMMIT lost its answer the worker reads its rows back, and
    "until the rows can be read, nothing else is processed". The COMMIT lands, its answer is lost,
    and the database refuses every connection for a while (psycopg 3, tests/support/lossy.py): no message is
    handed to the processor meanwhile, though a backlog waits; then the batch counts as landed."""
    caplog.set_level(logging.INFO, logger="kstore")
    faults = Faults(down_after_fault=True)
    monkeypatch.setattr(kstore.engine.worker, "make_engine", lambda s: lossy_engine(s, faults))
    topic = new_topic(2)
    expected = set(produce(topic, [f"a{i}" for i in range(20)]))
    proc = CountingRecorder()
    worker = Worker(proc, Settings(dsn=with_driver(pg_dsn, "psycopg"), bootstrap_servers=kafka, group="held",
                                   topics=(topic,), max_batch_size=20, session_timeout_ms=6000,
                                   heartbeat_interval_ms=1000, kafka_client=KAFKA_CLIENT))
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 60, what="the first messages")
        faults.commits.append("lost")
        expected |= set(produce(topic, [f"b{i}" for i in range(200)]))
        wait_until(lambda: faults.cut and faults.refused_connections >= 3, 60,
                   what="the lost COMMIT, then read backs refused")
        handled, refused = proc.handled, faults.refused_connections
        wait_until(lambda: faults.refused_connections >= refused + 3, 60, what="more read backs refused")
        assert proc.handled == handled, "messages were processed while the lost COMMIT was unresolved"
        assert faults.cut[0].wrote("effects"), faults.cut  # the fault took a batch's COMMIT
        faults.down = False
        wait_until(lambda: len(effects(pg_dsn)) >= len(expected), 90, what="every message processed")
    finally:
        faults.down = False
        worker.request_stop()
        runner.join(60)
    assert_exactly_once(effects(pg_dsn), expected)
    assert "lost its answer" in caplog.text and "but landed: not processing it again" in caplog.text
