"""Declared output topics: a processor's ``produces`` is checked at the worker's start, ``produce()`` to
any other topic stops the worker, and a topic that is missing while the worker runs is an outage
(waited out, never a dead letter). ``kstore.testing.run_batch`` checks what it produces as the worker
does, and ``kstore topics`` lists and creates a processor's topics.

Real ``kstore worker`` and ``kstore relay`` processes, a real broker and a real PostgreSQL. The
tests of a deleted topic run on a broker of their own that creates topics when asked for one
(``auto.create.topics.enable``, Kafka's default), so that anything in kstore asking for it would
bring it back; the tests' shared broker never creates a topic.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from kstore import Message, MissingTopicError, Processor, ProduceError, Settings, UndeclaredTopicError
from kstore.ops.replay import replay_matching
from kstore.testing import make_message, run_batch
from kstore_devbroker.broker import Cluster
from tests.conftest import BROKER_CONFIG, KAFKA_CLIENT, TEST_SESSION_TIMEOUT_MS
from tests.integration.cli.test_cli import assert_one_clear_line, kstore
from tests.integration.failures_and_dead_letters.test_dead_letters_at_scale import dead_letter, rows
from tests.integration.outbox.test_outbox import outbox_rows, wait_done
from tests.integration.telemetry.test_metrics import get, port_of, scrape, total
from tests.support.harness import WorkerProcess, effects, read_committed, stored_offsets, wait_until

ANNOUNCER = "topic_processors:Announcer"


def dead_letters(dsn: str) -> int:
    return int(rows(dsn, "SELECT count(*) AS n FROM kstore_dead_letters")[0].n)


def topic_exists(admin: Any, topic: str) -> bool:
    described = admin.describe_topics([topic])
    return bool(described) and described[0].get("error_code") == 0


def create_topic(admin: Any, topic: str, partitions: int) -> None:
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    wait_until(lambda: topic_exists(admin, topic), 30, what=f"topic {topic} created")




# -- at the worker's start --------------------------------------------------------------------------


def test_a_missing_declared_output_topic_stops_the_start_with_one_line(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any) -> None:
    """``produces`` names a topic the cluster lacks: the worker does not start (one line, exit 2),
    and none of the waiting messages is handled or dead-lettered."""
    source = new_topic(partitions=1)
    missing = f"order-reserved-{uuid.uuid4().hex[:8]}"
    produce(source, ["a", "b", "c"])
    r = kstore("worker", ANNOUNCER, "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--topic", source,
               env={"KSTORE_TEST_OUT_TOPIC": missing, "KSTORE_KAFKA_CLIENT": KAFKA_CLIENT})
    assert_one_clear_line(r, f"output topic {missing!r} does not exist", "kstore topics create")
    assert dead_letters(pg_dsn) == 0
    assert not effects(pg_dsn)
    assert not any(stored_offsets(pg_dsn, "announcer").values())


# -- produce() to a topic not declared --------------------------------------------------------------


@pytest.mark.parametrize("processor", [ANNOUNCER, "topic_processors:CatchingAnnouncer"])
def test_produce_to_an_undeclared_topic_stops_the_worker_and_dead_letters_nothing(
        pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any, processor: str) -> None:
    """A programming error, not the message's fault (even with on_error="dead_letter", and even if the
    processor catches the error): the worker stops with one line, exit 1; nothing of the batch
    commits, nothing is dead-lettered or published, and the stored offset does not move."""
    source, out = new_topic(partitions=1), new_topic(partitions=1)
    produce(source, ["ok0", "ok1", "stray", "ok3"])
    w = workers(pg_dsn, source, "announcer", processor, env={"KSTORE_TEST_OUT_TOPIC": out})
    assert w.wait(120) == 1, w.log
    assert "produce() to topic 'never-declared', which is not in produces" in w.log
    assert "Traceback" not in w.log
    assert dead_letters(pg_dsn) == 0
    assert not effects(pg_dsn)
    assert not any(stored_offsets(pg_dsn, "announcer").values())
    assert outbox_rows(pg_dsn) == 0
    assert read_committed(kafka, out) == []


# -- a topic deleted while the worker runs ----------------------------------------------------------


@pytest.fixture(scope="module")
def autocreating_kafka() -> Iterator[str]:
    """A broker of these tests' own that creates a topic whenever a client asks it to."""
    cluster = Cluster(1, extra_config={**BROKER_CONFIG, "auto.create.topics.enable": "true"})
    cluster.start()
    try:
        yield cluster.bootstrap_servers
    finally:
        cluster.stop()


@pytest.fixture
def kafka_admin(autocreating_kafka: str) -> Iterator[Any]:
    admin = KafkaAdminClient(bootstrap_servers=autocreating_kafka)
    yield admin
    admin.close()


@pytest.fixture
def send(autocreating_kafka: str) -> Iterator[Any]:
    producer = KafkaProducer(bootstrap_servers=autocreating_kafka, acks="all", allow_auto_create_topics=False)

    def send_values(topic: str, values: list[str]) -> list[tuple[str, int, int]]:
        futures = [producer.send(topic, value=v.encode(), key=v.encode()) for v in values]
        producer.flush()
        return [(m.topic, m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)]

    yield send_values
    producer.close()


def test_a_topic_deleted_while_the_worker_runs_is_waited_for_then_produced_to_exactly_once(
        pg_dsn: str, autocreating_kafka: str, kafka_admin: Any, send: Any, workers: Any) -> None:
    """The output topic is deleted under a running worker: its batches are rolled back and wait
    (nothing dead-lettered, the offsets stay, /readyz says why, the rolled-back metric counts
    ``missing_topic``) and nothing recreates the topic, though the broker would; once an operator
    creates it again, every message waiting is handled and published once."""
    source, out = f"in-{uuid.uuid4().hex[:8]}", f"out-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_admin, source, 2)
    create_topic(kafka_admin, out, 2)
    w = workers(pg_dsn, source, "announcer", ANNOUNCER,
                env={"KSTORE_TEST_OUT_TOPIC": out, "KSTORE_TOPIC_RECHECK_S": "0.5"},
                args=["--bootstrap-servers", autocreating_kafka, "--metrics-port", "0", "--on-error", "dead_letter"])
    port = port_of(w)
    before = send(source, [f"before{i}" for i in range(20)])
    wait_done(pg_dsn, "announcer", before)
    assert sorted(v for _, v in read_committed(autocreating_kafka, out)) == sorted(
        f"before{i}".encode() for i in range(20))

    kafka_admin.delete_topics([out])
    wait_until(lambda: not topic_exists(kafka_admin, out), 30, what=f"topic {out} deleted")
    during: list[tuple[str, int, int]] = []

    def waiting() -> bool:
        during.extend(send(source, [f"during{len(during)}"]))  # until a batch meets the missing topic
        status, body = get(port, "/readyz")
        return status == 503 and f"output topic {out!r} does not exist" in body

    wait_until(waiting, 60, interval=0.5, what="the worker waiting for the deleted topic")
    rolled_back = total(scrape(port), "kstore_batches_rolled_back_total", reason="missing_topic")
    assert rolled_back >= 1
    stored = stored_offsets(pg_dsn, "announcer")
    wait_until(lambda: total(scrape(port), "kstore_batches_rolled_back_total", reason="missing_topic")
               >= rolled_back + 2, 60, what="the batch tried again and rolled back again")
    assert stored_offsets(pg_dsn, "announcer") == stored, "the offsets moved while the topic was missing"
    assert dead_letters(pg_dsn) == 0
    assert not topic_exists(kafka_admin, out), "something recreated the deleted topic"
    assert w.proc.poll() is None
    assert "does not exist" in w.log and "waits (nothing is dead-lettered)" in w.log

    create_topic(kafka_admin, out, 2)
    wait_done(pg_dsn, "announcer", before + during)
    wait_until(lambda: get(port, "/readyz")[0] == 200, 60, what="ready again")
    values = [v for _, v in read_committed(autocreating_kafka, out)]
    assert sorted(values) == sorted(f"during{i}".encode() for i in range(len(during))), values
    counts = effects(pg_dsn)
    assert set(counts) == set(before + during) and set(counts.values()) == {1}
    assert dead_letters(pg_dsn) == 0
    assert w.terminate() == 0


@pytest.mark.parametrize("relay_client", ["kafka-python", "confluent"])
def test_the_relay_waits_for_a_deleted_topic_and_never_creates_it(
        pg_dsn: str, autocreating_kafka: str, kafka_admin: Any, send: Any, workers: Any, tmp_path: Path,
        relay_client: str) -> None:
    """Records committed to the outbox for a topic deleted before they were published: the relay's
    producer does not recreate it (the broker would, with its own defaults), the rows wait, and once
    the topic is created again they are published once."""
    source, out = f"in-{uuid.uuid4().hex[:8]}", f"out-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_admin, source, 1)
    create_topic(kafka_admin, out, 3)
    sent = send(source, [f"v{i}" for i in range(10)])
    w = workers(pg_dsn, source, "announcer", ANNOUNCER, env={"KSTORE_TEST_OUT_TOPIC": out},
                args=["--bootstrap-servers", autocreating_kafka, "--no-relay"])
    wait_until(lambda: (stored_offsets(pg_dsn, "announcer").get((source, 0)) or 0) >= 10, 120,
               what="the messages committed")
    assert w.terminate() == 0
    assert outbox_rows(pg_dsn) == 10

    kafka_admin.delete_topics([out])
    wait_until(lambda: not topic_exists(kafka_admin, out), 30, what=f"topic {out} deleted")
    env = {"KSTORE_RELAY_CLIENT": relay_client, "KSTORE_CONNECT_TIMEOUT_S": "3",
           "KSTORE_SESSION_TIMEOUT_MS": str(TEST_SESSION_TIMEOUT_MS)}
    relay = WorkerProcess(["--log-level", "DEBUG", "relay", "--dsn", pg_dsn, "--group", "announcer",
                           "--bootstrap-servers", autocreating_kafka], env, tmp_path / "relay.log")
    try:
        relay.wait_for_log(r"outbox shard \d+ of group 'announcer'.*(the rows wait|stopped on row)", timeout=90)
        assert not topic_exists(kafka_admin, out), "the relay's producer created the deleted topic"
        assert outbox_rows(pg_dsn) == 10
        create_topic(kafka_admin, out, 3)
        wait_done(pg_dsn, "announcer", sent, timeout=180)
        assert sorted(v for _, v in read_committed(autocreating_kafka, out)) == sorted(
            f"v{i}".encode() for i in range(10))
        assert relay.terminate() == 0
    finally:
        relay.cleanup()


# -- kstore.testing.run_batch checks as the worker does ---------------------------------------------


class Huge(Processor):
    produces = ["out"]

    def handle(self, msg: Message) -> None:
        self.produce("out", b"x" * 2_000_000 if msg.value == "huge" else msg.value)


class Undeclared(Processor):
    produces = ["out"]
    on_error = "dead_letter"

    def handle(self, msg: Message) -> None:
        self.produce("elsewhere", msg.value)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Any]:
    e = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    yield e
    e.dispose()


def test_run_batch_refuses_an_oversize_record_as_the_worker_does(engine: Any) -> None:
    """The worker's size limit (outbox_max_record_bytes) applies to run_batch: with on_error="stop"
    the ProduceError is raised, with "dead_letter" the message comes back rejected, the rest committed."""
    with pytest.raises(ProduceError, match="over outbox_max_record_bytes=1,000,000"):
        run_batch(Huge(), [make_message("huge")], engine)
    outcome = run_batch(Huge(), [make_message("small"), make_message("huge", offset=1)], engine,
                        on_error="dead_letter")
    assert [r.value for r in outcome.produced] == [b"small"]
    assert [(r.message.offset, type(r.error).__name__) for r in outcome.rejected] == [(1, "ProduceError")]


def test_run_batch_stops_on_an_undeclared_topic_whatever_on_error_says(engine: Any) -> None:
    with pytest.raises(UndeclaredTopicError, match="'elsewhere', which is not in produces \\(out\\)"):
        run_batch(Undeclared(), [make_message("a"), make_message("b", offset=1)], engine)


# -- dead-letter replays check as the worker does ---------------------------------------------------


#: The topic the replayed processor declares (made by the test, once per session).
REPLAY_OUT = f"replay-out-{uuid.uuid4().hex[:8]}"


class Replayed(Processor):
    """Records each replayed message and produces it to ``REPLAY_OUT`` (declared); ``stray`` to a
    topic it did not declare."""

    value_format = "str"
    produces = [REPLAY_OUT]

    def handle(self, msg: Message) -> None:
        self.session.execute(sa.text("INSERT INTO effects (topic, partition_id, kafka_offset, value, worker) "
                                     "VALUES (:t, :p, :o, :v, 'replay')"),
                             {"t": msg.topic, "p": msg.partition, "o": msg.offset, "v": msg.value})
        self.produce("never-declared" if msg.value == "stray" else REPLAY_OUT, msg.value)


class ToMissing(Processor):
    """Produces every replayed message to a declared topic the cluster does not have."""

    value_format = "str"
    produces = [f"missing-{uuid.uuid4().hex[:8]}"]

    def handle(self, msg: Message) -> None:
        self.produce(self.produces[0], msg.value)


def test_a_replay_stops_at_an_undeclared_or_missing_topic_and_fails_no_letter(
        pg_dsn: str, kafka: str, new_topic: Any) -> None:
    """A replay applies the worker's checks: ``produce()`` to an undeclared topic stops the walk with
    UndeclaredTopicError, and a declared topic the cluster lacks with MissingTopicError; neither is
    the letter's failure (it stays dead, its attempts unchanged), and what was replayed before stays."""
    ids = dead_letter(pg_dsn, 4, value=lambda i: "stray" if i == 2 else f"ok-{i}")
    new_topic(partitions=1, name=REPLAY_OUT)
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka, kafka_client=KAFKA_CLIENT)
    with pytest.raises(UndeclaredTopicError, match="before it this command replayed 2, failed 0"):
        replay_matching(settings, Replayed(), "g")
    letters = {r.id: (r.status, r.attempts) for r in rows(pg_dsn, "SELECT id, status, attempts FROM "
                                                                   "kstore_dead_letters")}
    assert [letters[i] for i in ids] == [("replayed", 1), ("replayed", 1), ("dead", 1), ("dead", 1)]

    with pytest.raises(MissingTopicError, match=r"does not exist .* before it this command replayed 0, failed 0"):
        replay_matching(settings, ToMissing(), "g")
    letters = {r.id: (r.status, r.attempts) for r in rows(pg_dsn, "SELECT id, status, attempts FROM "
                                                                   "kstore_dead_letters")}
    assert [letters[i] for i in ids[2:]] == [("dead", 1), ("dead", 1)]
    assert outbox_rows(pg_dsn) == 2  # the two replayed before the stop, for their relay to publish


# -- kstore topics ----------------------------------------------------------------------------------


def test_topics_list_and_create(kafka: str, new_topic: Any) -> None:
    """``kstore topics list`` shows the processor's input and declared output topics and which exist;
    ``create`` makes the missing ones with the partitions asked for and leaves the others alone."""
    source = new_topic(partitions=2)
    out = f"order-reserved-{uuid.uuid4().hex[:8]}"
    env = {"KSTORE_TEST_OUT_TOPIC": out}
    listed = kstore("topics", "list", ANNOUNCER, "--topic", source, "--bootstrap-servers", kafka, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [
        {"topic": source, "role": "input", "partitions": 2, "created": False, "exists": True},
        {"topic": out, "role": "output", "partitions": 0, "created": False, "exists": False}]
    made = kstore("topics", "create", ANNOUNCER, "--topic", source, "--bootstrap-servers", kafka,
                  "--partitions", "3", "--replication-factor", "1", env=env)
    assert made.returncode == 0, made.stderr
    rows = {line.split()[0]: line.split() for line in made.stdout.splitlines()[1:]}
    assert rows[source] == [source, "input", "2", "exists"]
    assert rows[out] == [out, "output", "3", "created"]
    again = kstore("topics", "list", ANNOUNCER, "--topic", source, "--bootstrap-servers", kafka, env=env)
    assert again.returncode == 0, again.stderr
    assert [line.split() for line in again.stdout.splitlines()[1:]] == [
        [source, "input", "2", "exists"], [out, "output", "3", "exists"]]
    refused = kstore("topics", "create", ANNOUNCER, "--topic", source, "--bootstrap-servers", kafka,
                     "--partitions", "0", env=env)
    assert_one_clear_line(refused, "partitions must be at least 1")
