"""The kstore demo: a real pipeline on the embedded SQLite default, crash included.

1. starts a local Apache Kafka broker (real jars, see kstore_devbroker.broker),
2. produces page-view events to a 3-partition topic,
3. runs ``kstore migrate`` and ``kstore worker pageviews:PageViewCounter`` with the default
   DSN (sqlite:///kstore.db, in .kstore-dev/demo/),
4. kills the worker with SIGKILL part-way through and starts it again,
5. prints the counts next to what was sent: every view counted exactly once.

``--pipeline payments`` runs Kafka -> database -> Kafka instead (examples/payments.py): payments
booked in a ledger, each announced on ``payment-booked`` through ``self.produce()``; the worker
is killed with SIGKILL while it books and publishes, and a ``read_committed`` reader of
``payment-booked`` then finds every booked payment announced exactly once, each account's
balances in order.

``--pipeline orders-avro`` runs Avro through a schema registry (examples/orders_avro.py): it also
starts a local schema registry (Apicurio Registry, Confluent's API; Java 21+), produces orders in
Avro, the first half with version 1 of their schema and the rest with version 2 (a field added),
plus a few records that are not Avro at all; the worker reads them all as version 2, accepts each
order and announces it on ``order-accepted`` in Avro, across a SIGKILL. A ``read_committed`` reader
decoding with confluent-kafka's ``AvroDeserializer`` then finds every order announced exactly once,
and exactly the bad records dead-lettered.

Pass ``--dsn postgresql+psycopg2://...`` to run the same pipeline on PostgreSQL, and
``--bootstrap-servers`` to use a broker you already run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from kstore.settings import Settings
from kstore_devbroker.broker import Cluster, DevBrokerError
from kstore_devbroker.registry import DevRegistry, fetch_registry, find_java21

EXAMPLES = Path(__file__).resolve().parent
WORKDIR = EXAMPLES.parent / ".kstore-dev" / "demo"
TOPIC = "page-views"
#: Records that are not Avro among the orders (``--pipeline orders-avro``): each is dead-lettered.
BAD_RECORDS = 20
PAGES = ["/", "/pricing", "/docs", "/blog/exactly-once", "/signup", "/about", "/careers", "/docs/offsets"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--dsn", default=None, help="default: kstore's embedded default, sqlite:///kstore.db")
    parser.add_argument("--bootstrap-servers", default=None, help="default: start a local broker")
    parser.add_argument("--no-crash", action="store_true", help="do not kill the worker part-way")
    parser.add_argument("--pipeline", choices=["pageviews", "payments", "orders-avro"], default="pageviews",
                        help="pageviews (Kafka -> database), payments (Kafka -> database -> Kafka) or orders-avro "
                             "(payments' path in Avro, through a schema registry)")
    args = parser.parse_args()
    pipelines = {"pageviews": run, "payments": run_payments, "orders-avro": run_orders_avro}

    shutil.rmtree(WORKDIR, ignore_errors=True)
    WORKDIR.mkdir(parents=True)
    if args.pipeline == "orders-avro":  # before the broker: a missing Java 21 or mvn ends the demo at once
        say("fetching the schema registry (cached after the first time)")
        try:
            fetch_registry()
            find_java21()
        except DevBrokerError as exc:
            sys.exit(f"demo: {exc}")
    cluster = None
    if args.bootstrap_servers is None:
        say("starting a local Apache Kafka broker (KRaft, from the official jars)...")
        cluster = Cluster(1).start()
        args.bootstrap_servers = cluster.bootstrap_servers
    try:
        return pipelines[args.pipeline](args)
    finally:
        if cluster is not None:
            cluster.stop()
            say("stopped the local broker")


def run(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap_servers
    say(f"broker at {bootstrap}; creating topic {TOPIC!r} with 3 partitions")
    create_topics(bootstrap, [TOPIC])

    sent = produce(bootstrap, args.events)
    dsn_args = ["--dsn", args.dsn] if args.dsn else []
    dsn = args.dsn or f"sqlite:///{WORKDIR / 'kstore.db'}"
    kstore("migrate", *dsn_args)

    worker_cmd = ["worker", "pageviews:PageViewCounter", "--bootstrap-servers", bootstrap, "--max-batch-size", "100",
                  *dsn_args]
    log_path = WORKDIR / "worker.log"
    worker = start_worker(worker_cmd, log_path)
    if not args.no_crash:
        wait_for(lambda: counted(dsn) >= args.events // 3, 120, worker, log_path)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        say(f"killed the worker with SIGKILL after {counted(dsn):,} of {args.events:,} views were counted; "
            f"starting it again. {session_wait()}")
        worker = start_worker(worker_cmd, log_path)
    wait_for(lambda: counted(dsn) >= args.events, 120, worker, log_path)
    time.sleep(1)  # anything counted twice would show up now
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(60)
    say(f"worker stopped with SIGTERM (exit {code}); its log is {log_path}")
    return report(dsn, sent) or code


def run_payments(args: argparse.Namespace) -> int:
    """Payments in, bookings and ``payment-booked`` records out, across a SIGKILL."""
    from payments import sample_payments

    bootstrap = args.bootstrap_servers
    create_topics(bootstrap, ["payments", "payment-booked"])
    payments = sample_payments(args.events, "demo")
    valid = {p["id"]: p for p in payments if p["amount"] > 0}
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 20})
    for p in payments:
        if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
            flush(producer)
        producer.produce("payments", json.dumps(p).encode(), p["account"].encode(), on_delivery=delivered)
    flush(producer)
    say(f"produced {len(payments):,} payments ({len(payments) - len(valid)} invalid) to 'payments'")
    dsn_args = ["--dsn", args.dsn] if args.dsn else []
    dsn = args.dsn or f"sqlite:///{WORKDIR / 'kstore.db'}"
    kstore("migrate", *dsn_args)
    cmd = ["worker", "payments:Payments", "--bootstrap-servers", bootstrap, "--max-batch-size", "100", *dsn_args]
    log_path = WORKDIR / "worker.log"
    worker = start_worker(cmd, log_path)
    if not args.no_crash:
        wait_for(lambda: rows(dsn, "payment_ledger") >= len(valid) // 3, 120, worker, log_path)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        say(f"killed the worker with SIGKILL after {rows(dsn, 'payment_ledger'):,} of {len(valid):,} payments were "
            f"booked (its relay mid-publish with it); starting it again. {session_wait()}")
        worker = start_worker(cmd, log_path)
    wait_for(lambda: rows(dsn, "payment_ledger") >= len(valid) and rows(dsn, "kstore_outbox") == 0, 180, worker,
             log_path)
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(60)
    say(f"worker stopped with SIGTERM (exit {code}); its log is {log_path}")
    return report_payments(bootstrap, valid) or code


def rows(dsn: str, table: str) -> int:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
    except (sa.exc.OperationalError, sa.exc.ProgrammingError):
        return 0 if table != "kstore_outbox" else 1  # not made yet
    finally:
        engine.dispose()


def read_committed(bootstrap: str, topic: str) -> list[Any]:
    """Every record value of ``topic`` a read_committed reader sees, up to each partition's end."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    # Assigned, not subscribed: the group id is never joined nor committed to. librdkafka reports
    # each partition's end (for a read_committed reader, its last stable offset) as an event.
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "kstore-demo-reader",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    values = []
    at_end: set[int] = set()
    while len(at_end) < len(partitions):
        for message in consumer.consume(1000, timeout=0.5):
            error = message.error()
            if error is None:
                values.append(message.value())
            elif error.code() == KafkaError._PARTITION_EOF:
                at_end.add(message.partition())
            else:
                sys.exit(f"demo: reading {topic} failed: {error}")
    consumer.close()
    return values


def report_payments(bootstrap: str, valid: dict[str, dict[str, object]]) -> int:
    """Read ``payment-booked`` as a read_committed reader; every booked payment once, balances in order."""
    records = [json.loads(value) for value in read_committed(bootstrap, "payment-booked")]
    seen = Counter(r["id"] for r in records)
    twice = sum(1 for n in seen.values() if n > 1)
    lost = len(set(valid) - set(seen))
    balances: dict[str, list[int]] = {}
    for r in records:
        balances.setdefault(r["account"], []).append(r["balance"])
    in_order = all(b == sorted(b) for b in balances.values())
    print()
    print(f"{'payments booked and announced':<34}{len(valid):>8}")
    print(f"{'payment-booked records read':<34}{len(records):>8}")
    print(f"{'  announced twice':<34}{twice:>8}")
    print(f"{'  never announced':<34}{lost:>8}")
    print(f"{'accounts, balances in order':<34}{sum(b == sorted(b) for b in balances.values()):>8} of {len(balances)}")
    ok = not twice and not lost and len(records) == len(valid) and in_order
    print()
    say("every payment booked once and announced exactly once, in order, across a SIGKILL and a restart"
        if ok else "RECORDS DIFFER")
    return 0 if ok else 1


def run_orders_avro(args: argparse.Namespace) -> int:
    """Avro orders in (two schema versions, and bad records), accepted orders and Avro
    ``order-accepted`` events out, through a schema registry, across a SIGKILL."""
    say("starting a local schema registry (Apicurio Registry, with Confluent's API)...")
    registry = DevRegistry(data_dir=WORKDIR / "registry")
    try:
        try:
            registry.start()
        except DevBrokerError as exc:
            sys.exit(f"demo: {exc}")
        return orders_avro_pipeline(args, registry.url)
    finally:
        registry.stop()
        say("stopped the schema registry")


def orders_avro_pipeline(args: argparse.Namespace, registry_url: str) -> int:
    """The topics, the orders and the bad records, the worker (killed part-way), then the report."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext
    from orders_avro import ORDER_PLACED_V1, ORDER_PLACED_V2

    bootstrap = args.bootstrap_servers
    say(f"schema registry at {registry_url}; creating topics 'orders' and 'order-accepted'")
    create_topics(bootstrap, ["orders", "order-accepted"])
    client = SchemaRegistryClient({"url": registry_url})
    context = SerializationContext("orders", MessageField.VALUE)
    v1, v2 = AvroSerializer(client, ORDER_PLACED_V1), AvroSerializer(client, ORDER_PLACED_V2)
    n = args.events
    rng = random.Random(7)
    # What each order's event must say: (customer, total in cents, currency).
    expected: dict[int, tuple[str, int, str]] = {}
    bad_at = {k * n // BAD_RECORDS + n // (2 * BAD_RECORDS) for k in range(BAD_RECORDS)}  # spread out
    bad_sent: set[tuple[int, int]] = set()  # (partition, offset) of each bad record

    def bad_delivered(error: object, message: Any) -> None:
        delivered(error, message)
        bad_sent.add((message.partition(), message.offset()))

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 20})
    for i in range(n):
        if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
            flush(producer)
        customer, cents = f"cust-{rng.randrange(100)}", rng.randint(100, 50_000)
        order = {"id": i, "customer": customer, "amount": cents / 100}
        if i < n // 2:  # version 1: no currency; read as version 2, with its default
            value, currency = v1(order, context), "EUR"
        else:  # the schema evolves mid-stream
            value, currency = v2({**order, "currency": "USD"}, context), "USD"
        expected[i] = (customer, cents, currency)
        producer.produce("orders", value, str(i).encode(), on_delivery=delivered)
        if i in bad_at:  # not in the wire format at all
            producer.produce("orders", f"order {i}, not in Avro".encode(), f"bad-{i}".encode(),
                             on_delivery=bad_delivered)
    flush(producer)
    say(f"produced {n:,} orders in Avro ({n // 2:,} with schema version 1, then {n - n // 2:,} with version 2) "
        f"and {len(bad_sent)} records that are not Avro to 'orders'")

    dsn_args = ["--dsn", args.dsn] if args.dsn else []
    dsn = args.dsn or f"sqlite:///{WORKDIR / 'kstore.db'}"
    kstore("migrate", *dsn_args)
    cmd = ["worker", "orders_avro:OrderAcceptor", "--bootstrap-servers", bootstrap, "--schema-registry-url",
           registry_url, "--max-batch-size", "100", *dsn_args]
    log_path = WORKDIR / "worker.log"
    worker = start_worker(cmd, log_path)
    if not args.no_crash:
        wait_for(lambda: rows(dsn, "accepted_orders") >= n // 3, 120, worker, log_path)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        say(f"killed the worker with SIGKILL after {rows(dsn, 'accepted_orders'):,} of {n:,} orders were "
            f"accepted (its relay mid-publish with it); starting it again. {session_wait()}")
        worker = start_worker(cmd, log_path)
    wait_for(lambda: rows(dsn, "accepted_orders") >= n and rows(dsn, "kstore_outbox") == 0
             and len(dead_lettered(dsn, "orders-avro")) >= len(bad_sent), 180, worker, log_path)
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(60)
    say(f"worker stopped with SIGTERM (exit {code}); its log is {log_path}")
    return report_orders_avro(bootstrap, registry_url, dsn, expected, bad_sent) or code


def dead_lettered(dsn: str, group: str) -> set[tuple[int, int]]:
    """The (partition, offset) of each message of ``group`` in kstore_dead_letters."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return {(p, o) for p, o in conn.execute(sa.text(
                'SELECT partition_id, "offset" FROM kstore_dead_letters WHERE consumer_group = :group'),
                {"group": group})}
    except (sa.exc.OperationalError, sa.exc.ProgrammingError):
        return set()  # not made yet
    finally:
        engine.dispose()


def report_orders_avro(bootstrap: str, registry_url: str, dsn: str, expected: dict[int, tuple[str, int, str]],
                       bad_sent: set[tuple[int, int]]) -> int:
    """Read ``order-accepted`` as a read_committed reader, decoding with confluent-kafka's AvroDeserializer:
    every order announced once, as it was placed; exactly the bad records dead-lettered."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    deserialize = AvroDeserializer(SchemaRegistryClient({"url": registry_url}))
    context = SerializationContext("order-accepted", MessageField.VALUE)
    events = [deserialize(value, context) for value in read_committed(bootstrap, "order-accepted")]
    seen = Counter(e["order_id"] for e in events)
    twice = sum(1 for n in seen.values() if n > 1)
    lost = len(set(expected) - set(seen))
    as_placed = all(expected.get(e["order_id"]) == (e["customer"], e["total_cents"], e["currency"]) for e in events)
    letters = dead_lettered(dsn, "orders-avro")
    v1 = {i for i, (*_, currency) in expected.items() if currency == "EUR"}
    v1_eur = sum(1 for e in events if e["order_id"] in v1 and e["currency"] == "EUR")
    print()
    print(f"{'orders accepted and announced':<34}{len(expected):>8}")
    print(f"{'order-accepted events read':<34}{len(events):>8}")
    print(f"{'  announced twice':<34}{twice:>8}")
    print(f"{'  never announced':<34}{lost:>8}")
    print(f"{'bad records dead-lettered':<34}{len(letters):>8} of {len(bad_sent)}")
    print(f"{'v1 orders read with currency EUR':<34}{v1_eur:>8} of {len(v1)}")
    ok = (not twice and not lost and len(events) == len(expected) and as_placed and letters == bad_sent
          and v1_eur == len(v1))
    print()
    say("every order accepted once and announced exactly once in Avro, across a schema change, bad records, "
        "a SIGKILL and a restart" if ok else "RECORDS DIFFER")
    return 0 if ok else 1


def produce(bootstrap: str, n: int) -> Counter[str]:
    rng = random.Random(42)
    weights = [40, 15, 20, 8, 6, 5, 2, 4]
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 20})
    sent: Counter[str] = Counter()
    for i in range(n):
        page = rng.choices(PAGES, weights)[0]
        event = {"page": page, "user": f"u{rng.randrange(5000)}", "n": i}
        if len(producer) >= 50_000:  # librdkafka's local queue holds 100,000 records: let it drain
            flush(producer)
        producer.produce(TOPIC, json.dumps(event).encode(), on_delivery=delivered)
        sent[page] += 1
    flush(producer)
    say(f"produced {n:,} page-view events")
    return sent


def create_topics(bootstrap: str, names: list[str]) -> None:
    """Create the topics of ``names`` that do not exist yet, 3 partitions each, and wait until they do."""
    # Warnings and errors only: librdkafka's notices (unserved events purged at close) are not the demo's.
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    existing = admin.list_topics(timeout=30).topics
    missing = [NewTopic(name, num_partitions=3, replication_factor=1) for name in names if name not in existing]
    if missing:
        for future in admin.create_topics(missing).values():
            future.result()


def delivered(error: object, _message: object) -> None:
    """librdkafka's report on each record: one it gave up on ends the demo."""
    if error is not None:
        sys.exit(f"demo: a record was not delivered: {error}")


def flush(producer: Producer) -> None:
    """Wait until every queued record is acknowledged by the broker."""
    while producer.flush(30):
        say("still waiting for the broker to acknowledge the records...")


def kstore(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kstore", *args], check=True, cwd=WORKDIR, env=env())


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])}


def start_worker(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    say("$ kstore " + " ".join(shown(arg) for arg in cmd))
    with log_path.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kstore", *cmd], cwd=WORKDIR, env=env(),
                                stdout=log, stderr=subprocess.STDOUT)


def shown(arg: str) -> str:
    """A command-line argument as the demo prints it: a DSN's password hidden."""
    if "://" not in arg:
        return arg
    return sa.make_url(arg).render_as_string(hide_password=True)


def counted(dsn: str) -> int:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT COALESCE(SUM(views), 0) FROM page_views")).scalar_one())
    except (sa.exc.OperationalError, sa.exc.ProgrammingError):
        return 0  # the worker has not created its table yet
    finally:
        engine.dispose()


def wait_for(done: object, timeout: float, worker: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        if worker.poll() is not None:
            sys.exit(f"demo: the worker exited with {worker.returncode}:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            sys.exit(f"demo: timed out; worker log:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)


def report(dsn: str, sent: Counter[str]) -> int:
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        views = dict(conn.execute(sa.text("SELECT page, views FROM page_views")).all())
    engine.dispose()
    print()
    print(f"{'page':<22}{'sent':>8}{'counted':>9}")
    for page, n in sent.most_common():
        mark = "" if views.get(page) == n else "   <-- MISMATCH"
        print(f"{page:<22}{n:>8}{views.get(page, 0):>9}{mark}")
    total = sum(views.values())
    print(f"{'total':<22}{sum(sent.values()):>8}{total:>9}")
    ok = views == dict(sent)
    print()
    say("every view counted exactly once, across a SIGKILL and a restart" if ok else "COUNTS DIFFER")
    return 0 if ok else 1


def session_wait() -> str:
    """Said after the SIGKILL: why nothing happens for a few seconds then (the worker's session, as it reads it)."""
    seconds = Settings.from_env().session_timeout_ms / 1000
    return (f"Kafka hears of a killed worker only when its session times out (KSTORE_SESSION_TIMEOUT_MS, "
            f"{seconds:g} s): until then the new one waits for its partitions (docs/operations.md)")


def say(message: str) -> None:
    print(f"demo: {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
