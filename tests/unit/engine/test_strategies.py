"""The failure strategies (kstore.engine.strategies), asked in on_error's order: a failed batch of several
messages is narrowed down, a message alone is retried in place while its policy allows, then it is
dead-lettered in its batch's place (on_error=dead_letter) or the worker stops (on_error=stop)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection

from kstore import ProcessorError, RetryPolicy, Settings, TooManyDeadLettersError, migrate
from kstore.db.store import make_engine
from kstore.engine.decoding import Batch, Decoded
from kstore.engine.failures import Failures
from kstore.engine.strategies import AGAIN, Chain, Failed, Instead, Strategy, Verdict, chain
from kstore.retry import DeserializationError, Reject
from kstore.telemetry.metrics import Metrics
from kstore.types import Message, Position, Produced, Record

from .test_ownership_races import Rec


class Outbox:
    """Where a dead letter's topic record is written: kept here to be looked at."""

    def __init__(self) -> None:
        self.records: list[Produced] = []

    def write(self, _conn: Connection, records: Sequence[Produced]) -> None:
        self.records += records


def batch(*offsets: int, partition: int = 0) -> Batch:
    records: list[Record] = [Rec("t", partition, o) for o in offsets]
    return Batch(records, {("t", partition): 1}, {("t", partition): Position(offsets[0], offsets[-1] + 1, 1)})


@dataclass
class Setup:
    settings: Settings
    metrics: Metrics
    failures: Failures
    requeued: list[list[int]]
    outbox: Outbox

    def chain(self, on_error: str, topic: str | None = None) -> Chain:
        return chain(on_error, processor_name="Orders", settings=self.settings, group="g", metrics=self.metrics,
                     failures=self.failures, outbox=self.outbox, dead_letter_topic=topic,
                     requeue=lambda records, _generations: self.requeued.append([r.offset for r in records]))

    def count(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"group": "g"}) or 0.0


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    settings = Settings(dsn=f"sqlite:///{tmp_path / 'letters.db'}", max_consecutive_dead_letters=2,
                        dead_letter_breaker="pause")
    return Setup(settings, Metrics("g"), Failures(RetryPolicy(max_attempts=2, backoff_s=0)), [], Outbox())


@pytest.fixture
def conn(setup: Setup) -> Iterator[Connection]:
    migrate(setup.settings)
    engine = make_engine(setup.settings)
    with engine.begin() as conn:
        yield conn
    engine.dispose()


@pytest.mark.parametrize("on_error", ["stop", "dead_letter"])
def test_a_failed_batch_of_several_is_narrowed_down_before_any_attempt_counts(setup: Setup, on_error: str) -> None:
    strategy = setup.chain(on_error)
    assert strategy.failed(batch(5, 6, 7, 8), ValueError("bad")) is AGAIN
    assert setup.failures.isolating(("t", 0)) and setup.failures.batch_size(500) == 2
    assert setup.count("kstore_retries_total") == 0


def test_on_error_stop_retries_a_message_alone_then_stops_the_worker(setup: Setup) -> None:
    strategy = setup.chain("stop")
    assert strategy.failed(batch(7), ValueError("bad")) is AGAIN
    assert setup.count("kstore_retries_total") == 1
    with pytest.raises(ProcessorError, match=r"processor Orders failed on t\[0\] offset 7 after 2 attempt\(s\): "
                                             r"ValueError: bad; its offset was not committed \(on_error=stop\)"):
        strategy.failed(batch(7), ValueError("bad"))


def test_on_error_dead_letter_commits_a_letter_in_the_place_of_an_exhausted_message(
        setup: Setup, conn: Connection) -> None:
    strategy = setup.chain("dead_letter", topic="letters")
    assert strategy.failed(batch(7), ValueError("bad")) is AGAIN
    verdict = strategy.failed(batch(7), ValueError("bad"))
    assert isinstance(verdict, Instead) and verdict.what == "a dead letter"
    [(record, failure)] = verdict.letters
    assert (record.offset, failure.attempts, failure.error) == (7, 2, "ValueError: bad")
    assert verdict.write(conn) == 1, "the letter's topic record goes to the outbox in the same transaction"
    assert [r.topic for r in setup.outbox.records] == ["letters"]
    letters = conn.execute(sa.text('SELECT "offset", attempts FROM kstore_dead_letters')).all()
    assert [tuple(r) for r in letters] == [(7, 2)]
    verdict.count()
    assert setup.count("kstore_dead_letters_written_total") == 1


def test_a_final_error_skips_the_retries(setup: Setup) -> None:
    verdict = setup.chain("dead_letter").failed(batch(7), Reject("not an order"))
    assert isinstance(verdict, Instead) and verdict.letters[0][1].final
    assert setup.count("kstore_retries_total") == 0


def test_dead_letter_sets_rejects_and_undecodable_messages_aside_in_the_batch(setup: Setup, conn: Connection) -> None:
    strategy = setup.chain("dead_letter")
    assert strategy.sets_aside and not setup.chain("stop").sets_aside
    taken = batch(5, 6, 7)
    records = taken.records
    msgs = [Message("t", 0, o, None, b"v", (), 0) for o in (5, 7)]
    decoded = Decoded(msgs, [records[0], records[2]], [(records[1], DeserializationError.of(ValueError("x")))])
    assert strategy.undecodable(taken, decoded) == (taken, decoded), "nothing is cut: the batch sets them aside"
    letters: list[tuple[Record, object]] = []
    handled = strategy.set_aside(conn, decoded, [(1, Reject("no"))], letters, None)  # type: ignore[arg-type]
    assert [m.offset for m in handled] == [5]
    assert [r.offset for r, _ in letters] == [6, 7], "in offset order"
    assert conn.execute(sa.text("SELECT count(*) FROM kstore_dead_letters")).scalar() == 2


def test_stop_cuts_a_batch_before_a_message_it_cannot_deserialize(setup: Setup) -> None:
    strategy = setup.chain("stop")
    taken = batch(5, 6, 7)
    records = taken.records
    msgs = [Message("t", 0, o, None, b"v", (), 0) for o in (5, 7)]
    error = DeserializationError.of(ValueError("x"))
    cut, decoded = strategy.undecodable(taken, Decoded(msgs, [records[0], records[2]], [(records[1], error)]))
    assert [r.offset for r in cut.records] == [5] and cut.positions == {("t", 0): Position(5, 6, 1)}
    assert [m.offset for m in decoded.msgs] == [5] and not decoded.undecodable
    assert setup.requeued == [[6, 7]]
    head = batch(6, 7)
    with pytest.raises(ProcessorError, match=r"cannot deserialize t\[0\] offset 6"):
        strategy.undecodable(head, Decoded(msgs[1:], [head.records[1]], [(head.records[0], error)]))
    assert setup.requeued[-1] == [6, 7], "the batch goes back whole before the worker stops"


@pytest.mark.parametrize("breaker", ["pause", "stop"])
def test_the_dead_letter_breaker_pauses_or_stops_after_letters_in_a_row(tmp_path: Path, breaker: str) -> None:
    settings = Settings(dsn=f"sqlite:///{tmp_path / 'b.db'}", max_consecutive_dead_letters=2,
                        dead_letter_breaker=breaker)
    setup = Setup(settings, Metrics("g"), Failures(RetryPolicy(max_attempts=1, backoff_s=0)), [], Outbox())
    strategy = setup.chain("dead_letter")
    letters = []
    for offset in (1, 2):
        verdict = strategy.failed(batch(offset), ValueError("bad"))
        assert isinstance(verdict, Instead)
        letters.append(verdict.letters)
    assert strategy.committed(batch(1).records, letters[0]) is None
    if breaker == "pause":
        assert "2 messages in a row failed every attempt" in (strategy.committed(batch(2).records, letters[1]) or "")
    else:
        with pytest.raises(TooManyDeadLettersError):
            strategy.committed(batch(2).records, letters[1])


def test_a_strategy_placed_before_the_last_decides_first(setup: Setup) -> None:
    """Another strategy is a class of its own put in the chain; the ones after it are not asked."""

    class Park(Strategy):
        def failed(self, failed: Failed) -> Verdict | None:
            return AGAIN if failed.failure is not None and failed.failure.attempts >= 2 else None

    default = setup.chain("stop")
    parked = Chain([*default.strategies[:-1], Park(), default.strategies[-1]])
    assert parked.failed(batch(7), ValueError("bad")) is AGAIN
    assert parked.failed(batch(7), ValueError("bad")) is AGAIN, "parked instead of stopping the worker"

