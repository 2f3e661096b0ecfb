"""The fetch queues' count of buffered bytes (``max_buffered_bytes``), under any order of fetches,
batches taken whole or in part, batches put back, and partitions dropped (no broker, no database).

A fetched run's bytes are summed once, when it is queued; a batch takes its share of a queue by
count, and the whole when it empties it. So the count is an estimate while a queue is partly
taken, and exact again whenever it is empty: it must never drift, never go negative, and be zero
when nothing is queued, or the throttle would pause fetching for good (or never).
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from kstore import Settings
from kstore.engine.partitions import Owned, Partitions
from kstore.kafka.confluent.consumer import messages_size, to_messages

TPS = [("t", 0), ("t", 1), ("t", 2)]


class _Client:
    """A client that is told to seek, pause and resume, and does nothing: the queues alone are tested."""

    size_of = staticmethod(messages_size)

    def seek(self, tp: Any, offset: int) -> None:
        pass

    def pause(self, tps: Any) -> None:
        pass

    resume = release = pause


def _check(source: Partitions) -> None:
    queues = source.queues().values()
    assert source._queued_records == sum(len(q.records) for q in queues)
    assert source._queued_bytes == sum(q.bytes for q in queues)
    for q in queues:
        assert (q.bytes == 0) == (not q.records)
        assert q.bytes >= len(q.records)  # every record counts at least its overhead


operations = st.lists(st.one_of(
    st.tuples(st.just("fetch"), st.sampled_from(TPS), st.lists(st.integers(0, 300), min_size=1, max_size=8)),
    st.tuples(st.just("take"), st.integers(1, 12), st.sampled_from([None, *TPS])),
    st.tuples(st.just("requeue")),
    st.tuples(st.just("own"), st.sampled_from(TPS)),
    st.tuples(st.just("disown"), st.sampled_from(TPS)),
), max_size=40)


def _apply(source: Partitions, op: Any, in_flight: list[tuple[list[Any], dict[Any, int]]]) -> None:
    """One operation, as the fetch thread (fetch) or the worker (the others) does it. Lock held."""
    kind = op[0]
    q = source.queues().get(op[1]) if kind in ("fetch", "own") else None
    if kind == "fetch" and q is not None:
        run = [Message(topic="t", partition=op[1][1], offset=q.next_fetch + i, key=None, value=b"v" * size,
                       timestamp=(1, 0)) for i, size in enumerate(op[2])]
        source._enqueue(q, to_messages(run, "t"))
    elif kind == "take":
        generations = {tp: q.generation for tp, q in source.queues().items()}
        batch, _, _ = source.take_batch(op[1], op[2])
        if batch:
            in_flight.append((batch, generations))
    elif kind == "requeue" and in_flight:
        source.requeue(*in_flight.pop())
    elif kind == "own":
        offset = 0 if q is None else q.next_fetch
        if q is None:
            source.assign([op[1]])  # revoked before: assigned again, then claimed
        source.own(op[1], Owned(1, offset), offset)
    elif kind == "disown":
        source.revoke([op[1]])


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_the_buffered_bytes_add_up_whatever_is_fetched_taken_put_back_or_dropped(ops: list[Any]) -> None:
    source = Partitions(Settings(max_buffered_bytes=2000), _Client())  # type: ignore[arg-type]
    in_flight: list[tuple[list[Any], dict[Any, int]]] = []
    with source.lock:
        source.assign(TPS)
        for tp in TPS:
            source.own(tp, Owned(1, 0), 0)
        for op in ops:
            _apply(source, op, in_flight)
            _check(source)
            source.check()
        if all(q.bytes == messages_size(list(q.records)) for q in source.queues().values()):
            # No queue partly taken: the count is the records' size itself.
            assert source._queued_bytes == sum(messages_size(list(q.records)) for q in source.queues().values())
        while source.take_batch(5)[0]:
            _check(source)
    assert source.buffered() == (0, 0, False)
