"""The two contenders, each in a child process (``benchmarks.child``): ``--threads`` request threads
sharing one SQLAlchemy engine (psycopg2, a pool of one connection per thread), each request one
transaction in a ``Session`` of its own, as a web application's request handler would write it.

Every request INSERTs its order row (id, customer) and produces one record, its order's event,
keyed by the customer:

- **kstore-app-outbox**: ``Outbox("bench-app", shards=16).produce(session, ...)`` inside the
  transaction; the record is written to the outbox in the session's commit and published by the
  ``kstore relay --outbox bench-app`` the parent started. Exactly once.
- **publish-after-commit**: the same transaction without the outbox; after COMMIT, a plain
  confluent-kafka ``Producer.produce()`` of the record (librdkafka's defaults, idempotence on,
  one producer shared by the threads), ``poll(0)``, and one ``flush()`` at the end. **At most
  once**: a crash (or a broker outage longer than ``message.timeout.ms``) between the COMMIT and the
  delivery loses the record, and nothing sends it again.

Requests are numbered 0..N-1 and taken in order by whichever thread is free: flat out, at
once; paced, request ``i`` not before ``i / rate`` seconds after the start (an absolute schedule:
a late request is not made up for by skipping), and none after the phase's seconds (a contender
that fell behind makes fewer). The clock starts once every thread holds a
connection (and the producer knows the topic).
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from ..meter import Meter
from .records import order_event, save

#: The application outbox's name and shards unless ``--shards`` (published by ``kstore relay --outbox OUTBOX``).
OUTBOX = "bench-app"
SHARDS = 16
#: The requests' connections, by name in ``pg_stat_activity`` (the parent samples what they wait for).
APPLICATION_NAME = "bench-app-requests"


def orders_table(name: str) -> sa.Table:
    return sa.Table(name, sa.MetaData(),
                    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
                    sa.Column("customer", sa.String(32), nullable=False))


#: What :meth:`Requests.run` notes per request (``time.time_ns()``, or a duration in ns for ``lock``): its
#: start, the end of its transaction's body, the end of its last SQL statement before COMMIT (for kstore,
#: the outbox write in the commit), its wait for kstore's shard locks and when it had them (0: never),
#: and its COMMIT returning.
STAMPS = ("ids", "begin", "body", "sql_end", "lock", "locked_at", "commit")

#: One request: its order id in; out, when its transaction's body ended (just before COMMIT) and when
#: its COMMIT returned (``time.time_ns()``).
Request = Callable[[int], tuple[int, int]]


class Requests:
    """The request threads of one phase, and what they note about each request."""

    def __init__(self, config: dict[str, Any], meter: Meter) -> None:
        self.config = config
        self.meter = meter
        self.n = int(config["messages"])
        self.threads = int(config["threads"])
        self.rate: float | None = config.get("rate")
        #: Paced: no request starts after this many seconds (one that fell behind does fewer).
        self.seconds: float | None = config.get("seconds")
        self.topic: str = config["out_topic"]
        self.engine = sa.create_engine(config["dsn"], pool_size=self.threads, max_overflow=0,
                                       connect_args={"application_name": APPLICATION_NAME})
        self.insert = orders_table(config["table"]).insert()
        if config.get("switch_interval"):  # diagnosis: how long a thread waits for the GIL back
            sys.setswitchinterval(float(config["switch_interval"]))
        self.failed: list[BaseException] = []
        self.stop = threading.Event()
        self._next = itertools.count().__next__  # atomic under the GIL: each id taken once
        self._start_mono = 0.0
        #: Per thread: when its last SQL statement returned, and how long the statements that lock kstore's
        #: shards took (their wait for the locks included: ``UPDATE ... next_seq``, or the one-statement
        #: write), timed by the engine's events (two calls per statement, both
        #: contenders alike). The statements kstore runs in the commit are on the same connection.
        self.marks = threading.local()
        event.listen(self.engine, "before_cursor_execute", self._before)
        event.listen(self.engine, "after_cursor_execute", self._after)

    def warm(self) -> None:
        """Every thread's connection opened before the clock (a pool fills lazily)."""
        barrier = threading.Barrier(self.threads)

        def hold() -> None:
            with self.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
                barrier.wait(60)

        threads = [threading.Thread(target=hold) for _ in range(self.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def run(self, request: Request, after_commit: Callable[[int], None] | None) -> dict[str, Any]:
        """All requests, on the threads; returns their stamps (see :meth:`_thread`)."""
        per_thread: list[list[list[int]]] = [[[] for _ in STAMPS] for _ in range(self.threads)]
        threads = [threading.Thread(target=self._thread, args=(request, after_commit, per_thread[t]),
                                    name=f"request-{t}") for t in range(self.threads)]
        self.meter.started()
        first_ns = time.time_ns()
        self._start_mono = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.failed:
            raise RuntimeError(f"a request failed: {self.failed[0]!r}") from self.failed[0]
        self.meter.counted(sum(len(lists[0]) for lists in per_thread))
        self.meter.finished()
        stamps: dict[str, Any] = {name: [x for lists in per_thread for x in lists[k]] for k, name in enumerate(STAMPS)}
        return {"first_ns": first_ns, **stamps}

    def _thread(self, request: Request, after_commit: Callable[[int], None] | None,
                out: list[list[int]]) -> None:
        ids, begun, bodies, sql_ends, locks, locked, committed = out
        marks = self.marks
        try:
            while not self.stop.is_set():
                i = self._next()
                if i >= self.n:
                    return
                if self.rate:
                    wait = self._start_mono + i / self.rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    elif self.seconds and time.monotonic() - self._start_mono >= self.seconds:
                        return  # behind the schedule, and out of time
                marks.lock = marks.locked_at = 0
                b = time.time_ns()
                body, c = request(i)
                if after_commit is not None:
                    after_commit(i)
                ids.append(i)
                begun.append(b)
                bodies.append(body)
                sql_ends.append(marks.end)
                locks.append(marks.lock)
                locked.append(marks.locked_at)
                committed.append(c)
        except BaseException as exc:
            self.failed.append(exc)
            self.stop.set()

    def _before(self, _conn: Any, _cursor: Any, _statement: str, *_: Any) -> None:
        self.marks.started = time.time_ns()

    def _after(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        marks = self.marks
        marks.end = time.time_ns()
        if "outbox_shards" in statement and "next_seq" in statement:  # kstore's outbox shards, locked in the commit
            marks.lock += marks.end - marks.started
            marks.locked_at = marks.end


def kstore_app(config: dict[str, Any], meter: Meter) -> None:
    """kstore-app-outbox: the record produced through :class:`kstore.outbox.Outbox` in the transaction."""
    from kstore import Settings
    from kstore.outbox import Outbox

    requests = Requests(config, meter)
    events = Outbox(OUTBOX, Settings.from_env(dsn=config["dsn"]), shards=int(config.get("shards") or SHARDS))
    engine, insert, topic = requests.engine, requests.insert, requests.topic
    events.setup(engine)
    requests.warm()

    def request(i: int) -> tuple[int, int]:
        event = order_event(i)
        with Session(engine) as session:
            with session.begin():
                session.execute(insert, {"id": i, "customer": event["customer"]})
                events.produce(session, topic, event, key=event["customer"])
                body = time.time_ns()
            return body, time.time_ns()  # committed (the outbox rows were written in the commit)

    stamps = requests.run(request, None)
    save(config["stamps_file"], stamps)
    engine.dispose()


def publish_after_commit(config: dict[str, Any], meter: Meter) -> None:
    """publish-after-commit: COMMIT, then a plain producer's ``produce()``; ``flush()`` at the end."""
    from confluent_kafka import KafkaError, Message, Producer

    requests = Requests(config, meter)
    engine, insert, topic = requests.engine, requests.insert, requests.topic
    producer = Producer({"bootstrap.servers": config["bootstrap"], "enable.idempotence": True,
                         "client.id": "bench-publish-after-commit"})
    producer.list_topics(topic, timeout=30)  # connected, the topic's leaders known, before the clock
    requests.warm()
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:  # the record is lost: its transaction committed, nothing sends it again
            failures.append(str(err))

    def request(i: int) -> tuple[int, int]:
        with Session(engine) as session:
            with session.begin():
                session.execute(insert, {"id": i, "customer": order_event(i)["customer"]})
                body = time.time_ns()
            return body, time.time_ns()  # committed

    def publish(i: int) -> None:
        event = order_event(i)
        while True:
            try:
                producer.produce(topic, json.dumps(event).encode(), key=event["customer"].encode(),
                                 on_delivery=delivered)
                break
            except BufferError:  # librdkafka's queue is full: let deliveries drain it
                producer.poll(0.05)
        producer.poll(0)

    stamps = requests.run(request, publish)
    started = time.monotonic()
    left = producer.flush(120)
    meter.extra.update(flush_s=round(time.monotonic() - started, 3), not_delivered=left + len(failures),
                       delivery_errors=failures[:5])
    save(config["stamps_file"], stamps)
    engine.dispose()
