"""Concurrency inside a batch, without Kafka: the scheduler (lanes, the limit, cancellation) stepped
with ``asyncio.sleep(0)``, and async processors run by ``run_batch`` / ``run_handler`` on SQLite."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sqlalchemy as sa

from kstore import Message, Processor, Reject
from kstore.errors import ConfigurationError, KstoreError, ProcessorContractError
from kstore.running.concurrency import BatchTimeout, HandlerCancelled, lanes, run_lanes
from kstore.running.handler import Outgoing, run_handler
from kstore.running.hooks import call_hook, check_processor
from kstore.testing import make_message, run_batch
from tests.support.harness import REPO_DIR

metadata = sa.MetaData()
rows = sa.Table("rows", metadata, sa.Column("offset", sa.Integer), sa.Column("key", sa.String(20)),
                sa.Column("seq", sa.Integer))


def msgs_with_keys(keys: Sequence[Any], partition: int = 0) -> list[Message]:
    return [make_message(f"v{i}", key=k, offset=i, partition=partition) for i, k in enumerate(keys)]


# -- lanes ---------------------------------------------------------------------------------------


def test_key_ordering_puts_one_keys_messages_in_one_lane_and_keyless_ones_in_their_partitions() -> None:
    ms = [*msgs_with_keys([b"a", b"b", b"a", None, None]), *msgs_with_keys([b"a", None], partition=1)]
    got = lanes(ms, "key")
    assert got[0] == got[2] != got[1]
    assert got[3] == got[4] and got[3] not in (got[0], got[1])
    assert got[5] != got[0] and got[6] != got[3]  # another partition: other lanes


def test_unhashable_keys_are_laned_by_their_json() -> None:
    got = lanes(msgs_with_keys([{"id": 1}, {"id": 2}, {"id": 1}]), "key")
    assert got[0] == got[2] != got[1]


def test_partition_and_none_orderings() -> None:
    ms = msgs_with_keys([b"a", b"b", b"a"])
    assert len(set(lanes(ms, "partition"))) == 1
    assert len(set(lanes(ms, "none"))) == 3


# -- the scheduler -------------------------------------------------------------------------------


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize("limit", [1, 3, 64])
def test_one_lanes_messages_run_one_after_another_in_order_and_the_limit_is_never_exceeded(limit: int) -> None:
    rng = random.Random(limit)
    lane_of = [rng.randrange(7) for _ in range(300)]
    started: list[int] = []
    active: set[int] = set()
    busy_lanes: set[int] = set()
    peak = 0

    async def work(i: int) -> None:
        nonlocal peak
        assert lane_of[i] not in busy_lanes, "two messages of one lane at once"
        busy_lanes.add(lane_of[i])
        active.add(i)
        peak = max(peak, len(active))
        started.append(i)
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        active.discard(i)
        busy_lanes.discard(lane_of[i])

    _run(run_lanes(lane_of, work, limit))
    assert sorted(started) == list(range(300))
    for lane in set(lane_of):
        mine = [i for i in started if lane_of[i] == lane]
        assert mine == sorted(mine)
    assert peak <= limit
    assert peak == min(limit, 7)  # and it is reached: the lanes do run side by side


def test_a_failure_cancels_the_messages_still_running_and_starts_no_more() -> None:
    cancelled: list[int] = []
    started: list[int] = []

    async def work(i: int) -> None:
        started.append(i)
        if i == 2:
            await asyncio.sleep(0)
            raise ValueError("boom")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    with pytest.raises(ValueError, match="boom"):
        _run(run_lanes(list(range(10)), work, 4))
    assert started == [0, 1, 2, 3]
    assert sorted(cancelled) == [0, 1, 3]


def test_a_batch_past_its_deadline_is_cancelled_and_fails() -> None:
    cancelled: list[int] = []

    async def work(i: int) -> None:
        if i == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(i)
                raise

    with pytest.raises(BatchTimeout, match="1 message"):
        _run(run_lanes([0, 1, 2], work, 8, timeout=0.05))
    assert cancelled == [1]


def test_a_handler_that_cancels_itself_fails_the_batch_as_an_ordinary_error() -> None:
    async def work(i: int) -> None:
        raise asyncio.CancelledError()

    with pytest.raises(HandlerCancelled):
        _run(run_lanes([0], work, 1))


def test_cancelling_the_batch_cancels_its_messages() -> None:
    cancelled: list[int] = []

    async def work(i: int) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def main() -> None:
        batch = asyncio.ensure_future(run_lanes([0, 1, 2], work, 2))
        for _ in range(3):
            await asyncio.sleep(0)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch

    _run(main())
    assert sorted(cancelled) == [0, 1]


# -- async processors ------------------------------------------------------------------------------


class Sequencer(Processor):
    """Writes (offset, key, its sequence number within the key) through the async session."""

    max_concurrency = 8

    def setup(self) -> None:
        metadata.create_all(self.engine)
        self.next_seq: dict[Any, int] = {}
        self.peak = self.now = 0

    async def handle(self, msg: Message) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(random.random() / 1000)
        seq = self.next_seq.get(msg.key, 0)
        self.next_seq[msg.key] = seq + 1
        await self.session.execute(rows.insert(), {"offset": msg.offset, "key": msg.key, "seq": seq})
        self.produce("out", str(msg.offset), key=msg.key)
        self.now -= 1


def test_run_batch_runs_an_async_processor_concurrently_in_key_order(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    p = Sequencer()
    keys = [f"k{i % 5}" for i in range(200)]
    outcome = run_batch(p, msgs_with_keys(keys), engine)
    with engine.connect() as conn:
        got = conn.execute(sa.select(rows.c.offset, rows.c.key, rows.c.seq)).all()
    assert sorted(r.offset for r in got) == list(range(200))
    for key in set(keys):
        # The n-th message of a key ran n-th: one key's messages in offset order.
        assert [r.offset for r in sorted((r for r in got if r.key == key), key=lambda r: r.seq)] == \
            [i for i, k in enumerate(keys) if k == key]
    assert 1 < p.peak <= 8
    # What it produced: in the order of the writes (each record right after its INSERT), so per key
    # in offset order; not the batch's offset order overall, since the handlers ran side by side.
    with engine.connect() as conn:
        written = conn.execute(sa.select(rows.c.offset).order_by(sa.literal_column("rowid"))).scalars().all()
    assert [int(r.value) for r in outcome.produced] == written != list(range(200))


stock = sa.Table("stock", metadata, sa.Column("product", sa.String(20), primary_key=True),
                 sa.Column("left", sa.Integer, nullable=False))


class TakesStock(Processor):
    """Read-modify-write on shared rows: each message (its own key) takes one from its product
    (``UPDATE ... RETURNING``), awaiting before and after it, and produces what was left."""

    max_concurrency = 16

    async def handle(self, msg: Message) -> None:
        await asyncio.sleep(random.random() / 1000)
        left = await self.session.scalar(sa.text('UPDATE stock SET "left" = "left" - 1 WHERE product = :p '
                                                 'RETURNING "left"'), {"p": msg.value})
        await asyncio.sleep(random.random() / 1000)
        self.produce("out", str(left), key=msg.value)


def test_what_concurrent_handlers_produce_follows_the_order_of_their_writes(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(stock.insert(), [{"product": f"p{i}", "left": 1000} for i in range(3)])
    outcome = run_batch(TakesStock(), [make_message(f"p{i % 3}", key=f"o{i}", offset=i) for i in range(300)],
                        engine)
    with engine.connect() as conn:
        left = {product: n for product, n in conn.execute(sa.select(stock.c.product, stock.c.left))}
    for product in left:
        seq = [int(r.value) for r in outcome.produced if r.key == product.encode()]
        # Per product, the stock going down one by one as the UPDATEs took it, ending at the database's.
        assert seq == list(range(999, left[product] - 1, -1)) and len(seq) == 100


class ProducesFirst(Processor):
    """The first message of a key writes, then produces; the next produces before any statement."""

    async def handle(self, msg: Message) -> None:
        if msg.offset == 0:
            await self.session.execute(sa.text("SELECT 1"))
        self.produce("out", str(msg.offset), key=msg.key)


def test_a_record_produced_before_any_statement_follows_what_its_key_produced_before(sqlite_dsn: str) -> None:
    outcome = run_batch(ProducesFirst(), msgs_with_keys(["a", "a"]), sa.create_engine(sqlite_dsn))
    assert [r.value for r in outcome.produced] == [b"0", b"1"]


class Failing(Processor):
    async def handle(self, msg: Message) -> None:
        await self.session.execute(rows.insert(), {"offset": msg.offset, "key": "x", "seq": 0})
        await asyncio.sleep(0)
        if msg.offset == 7:
            raise ValueError("bad message")


def test_a_failing_message_fails_the_whole_batch_and_nothing_commits(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    with pytest.raises(ValueError, match="bad message"):
        run_batch(Failing(), msgs_with_keys([f"k{i}" for i in range(20)]), engine)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(rows)).scalar() == 0


class Rejecting(Processor):
    async def handle(self, msg: Message) -> None:
        if msg.value == "v3":
            raise Reject("unusable")
        if msg.value == "v5":
            self.produce("out", "before")
            await asyncio.sleep(0)
            raise Reject("unusable too")
        await self.session.execute(rows.insert(), {"offset": msg.offset, "key": "x", "seq": 0})
        self.produce("out", msg.value)


def test_a_reject_before_the_message_used_the_session_is_set_aside_and_the_rest_go_on(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    p = Rejecting()
    rejects: list[tuple[int, Exception]] = []
    outgoing = Outgoing()
    with engine.connect() as conn, conn.begin():
        run_handler(p, conn, msgs_with_keys([f"k{i}" for i in range(8)]), rejects=rejects, outgoing=outgoing)
    assert [i for i, _ in rejects] == [3, 5]
    assert [r.value for r in outgoing.records] == [b"v0", b"v1", b"v2", b"v4", b"v6", b"v7"]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(rows)).scalar() == 6


class RejectsAfterWriting(Processor):
    async def handle(self, msg: Message) -> None:
        await self.session.execute(rows.insert(), {"offset": msg.offset, "key": "x", "seq": 0})
        raise Reject("after a write")


def test_a_reject_after_the_message_used_the_session_fails_the_batch(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    with engine.connect() as conn, conn.begin(), pytest.raises(Reject):
        run_handler(RejectsAfterWriting(), conn, msgs_with_keys(["a"]), rejects=[])


class ForgetsAwait(Processor):
    async def handle(self, msg: Message) -> None:
        self.session.execute(rows.insert(), {"offset": msg.offset, "key": "x", "seq": 0})


def test_a_session_call_without_await_is_refused_and_nothing_commits(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    with pytest.raises(ProcessorContractError, match=r"self.session.execute\(...\) without `await`"):
        run_batch(ForgetsAwait(), msgs_with_keys(["a", "b"]), engine)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(rows)).scalar() == 0


class UsesSyncApi(Processor):
    async def handle(self, msg: Message) -> None:
        self.session.add(object())


def test_the_sync_sessions_other_methods_say_how_to_reach_them(sqlite_dsn: str) -> None:
    with pytest.raises(KstoreError, match="run_sync"):
        run_batch(UsesSyncApi(), msgs_with_keys(["a"]), sqlite_dsn)


class Savepoints(Processor):
    """Message 0 holds a savepoint across an await; the others' statements must not land inside it."""

    ordering = "none"

    async def handle(self, msg: Message) -> None:
        if msg.offset == 0:
            with pytest.raises(ValueError):
                async with self.session.begin_nested():
                    await self.session.execute(rows.insert(), {"offset": 0, "key": "sp", "seq": 0})
                    for _ in range(5):
                        await asyncio.sleep(0)  # the others run meanwhile, and wait for the session
                    raise ValueError("undo the savepoint")
            return
        await self.session.execute(rows.insert(), {"offset": msg.offset, "key": "x", "seq": 0})


def test_a_savepoint_holds_the_session_so_other_handlers_statements_wait_outside_it(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    run_batch(Savepoints(), msgs_with_keys(["a", "b", "c", "d"]), engine)
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(rows.c.offset)).scalars()) == [1, 2, 3]


class AsyncSetup(Processor):
    async def setup(self) -> None:
        self.loop = asyncio.get_running_loop()

    async def handle(self, msg: Message) -> None:
        assert asyncio.get_running_loop() is self.loop  # one loop: clients made in setup work in handle


def test_async_setup_runs_on_the_loop_the_handlers_run_on(sqlite_dsn: str) -> None:
    run_batch(AsyncSetup(), msgs_with_keys(["a"]), sqlite_dsn)


class CustomBatch(Processor):
    async def handle_batch(self, msgs: Sequence[Message]) -> None:
        await asyncio.gather(*(self.session.execute(rows.insert(), {"offset": m.offset, "key": "x", "seq": 0})
                               for m in msgs))


def test_an_async_handle_batch_runs_with_the_async_session(sqlite_dsn: str) -> None:
    engine = sa.create_engine(sqlite_dsn)
    metadata.create_all(engine)
    run_batch(CustomBatch(), msgs_with_keys(["a", "b", "c"]), engine)
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(rows.c.offset)).scalars()) == [0, 1, 2]


def test_async_hooks_kstore_cannot_run_are_still_refused() -> None:
    class AsyncCommitted(Processor):
        async def on_committed(self, msgs: Sequence[Message]) -> None: ...

    class Mixed(Processor):
        async def handle(self, msg: Message) -> None: ...

        def handle_batch(self, msgs: Sequence[Message]) -> None: ...

    class BadLimit(Processor):
        max_concurrency = 0

        async def handle(self, msg: Message) -> None: ...

    with pytest.raises(ConfigurationError, match="on_committed is `async def`"):
        check_processor(AsyncCommitted())
    with pytest.raises(ConfigurationError, match="handle_batch is a plain `def`"):
        check_processor(Mixed())
    with pytest.raises(ConfigurationError, match="max_concurrency"):
        check_processor(BadLimit())
    check_processor(Sequencer())


# -- the worked example: examples/enrich.py against a local HTTP service ------------------------------


class _Prices(BaseHTTPRequestHandler):
    calls = 0
    in_flight = peak = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        cls = type(self)
        with cls.lock:
            cls.calls += 1
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        time.sleep(0.02)  # a slow service: concurrent calls overlap
        body = json.dumps({"price": 2.5}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        with cls.lock:
            cls.in_flight -= 1

    def log_message(self, *args: Any) -> None:
        pass


def test_the_enrich_example_calls_its_http_service_concurrently_and_writes_each_order_once(
        sqlite_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prices)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PRICES_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.syspath_prepend(str(REPO_DIR / "examples"))
    from enrich import OrderPricer  # type: ignore[import-not-found]

    engine = sa.create_engine(sqlite_dsn)
    pricer = OrderPricer()
    try:
        for first in (0, 40):  # two batches: the client made in setup() works in both
            orders = [make_message({"order": f"o{i}", "sku": "A-1", "qty": 2}, key=f"c{i % 10}", offset=i)
                      for i in range(first, first + 40)]
            run_batch(pricer, orders, engine)
        call_hook(pricer, "teardown")
    finally:
        server.shutdown()
    with engine.connect() as conn:
        got = conn.execute(sa.text("SELECT order_id, total FROM priced_orders")).all()
    assert sorted(got) == sorted((f"o{i}", 5.0) for i in range(80))
    assert _Prices.calls == 80
    assert _Prices.peak > 1  # the calls overlapped
