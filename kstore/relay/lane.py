"""One lane a relay holds: its publisher, how far it published, its backoff and why it waits; and the
timings a lane keeps to.

A lane's state is written by the lane's own thread (or by :meth:`kstore.relay.loop.Relay.turn`);
the lease thread only tells it to stop (:attr:`Lane.stop`) and forgets it once it is lost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .publisher import LanePublisher
from .tables import Pending

#: Rows per Kafka transaction, at most.
MAX_ROWS_PER_TRANSACTION = 5000
#: A shard stopped on a row Kafka refused is tried again after this long at first, the wait doubling
#: each time up to BLOCKED_RETRY_S: a topic made again is published to at once, a row that stays
#: refused costs a transaction every 30 s.
BLOCKED_RETRY_FIRST_S = 1.0
BLOCKED_RETRY_S = 30.0
#: First and longest wait after the broker or the database failed a shard.
RETRY_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 10.0
#: After a shard's producer was fenced, how long before the lease is checked and a new one made.
FENCED_RETRY_S = 1.0
#: A lane whose shard a writer held locked as it was about to sleep looks for rows again after this long.
BUSY_RECHECK_S = 0.005
#: How often, at most, a busy shard writes its "published" mark (and deletes what it published).
MARK_INTERVAL_S = 1.0
#: A lane's first producer, on a broker just started, meets "not now" answers (a coordinator still
#: loading) and backs off: routine, said at INFO for this long; a WARNING past it, when something keeps
#: the brokers from answering (a coordinator loads within seconds).
NOT_READY_ROUTINE_S = 30.0


@dataclass
class Lane:
    """One held lane: written by its own thread (or by :meth:`kstore.relay.loop.Relay.turn`), told to stop
    by the lease thread."""

    lane: int
    shards: tuple[int, ...]
    epoch: int
    publisher: LanePublisher | None = None
    #: The shards' incarnation its publisher's progress marks carry (read when it was made).
    incarnation: str | None = None
    #: The highest seq of each shard known published (read from Kafka when the publisher was made).
    published: dict[int, int] = field(default_factory=dict)
    #: The highest seq of each shard marked published in the database, and when.
    marked: dict[int, int] = field(default_factory=dict)
    marked_at: float = 0.0
    #: Not before this monotonic time is the lane tried again (a failure's backoff, a refused row).
    not_before: float = 0.0
    delay: float = RETRY_DELAY_S
    #: The (shard, seq) of the row Kafka refused, until the lane publishes again.
    blocked_on: tuple[int, int] | None = None
    #: The wait after the next refusal: doubled by each, back to the first once the lane publishes.
    blocked_delay: float = BLOCKED_RETRY_FIRST_S
    #: After a transaction in which Kafka refused a row, the lane publishes a row a transaction until
    #: each shard is published up to its seq here: the rows before the refused one go out, and the
    #: one to blame is named exactly (a broker refuses a whole request of records for one record too large).
    single_until: dict[int, int] = field(default_factory=dict)
    #: Since when (monotonic) a Kafka call of the lane has been under way; None between calls.
    publishing_since: float | None = None
    #: The relay's paused time (``Relay._paused_s``) when that call began.
    paused_before: float = 0.0
    #: The lease is no longer ours (found by the lane itself): the lease thread forgets it.
    lost: bool = False
    #: ``published`` when the lane last found rows committed as it was about to sleep (see
    #: LanePublishing._sleep_until_written), None once it slept.
    woken_at: dict[int, int] | None = None
    last_error: str | None = None
    #: A producer was opened for the lane (after that, "not now" from the brokers is no longer routine).
    opened: bool = False
    #: Since when (monotonic) the brokers have answered the lane's first start "not now", and the last
    #: such failure said (at INFO).
    not_ready_since: float | None = None
    not_ready_said: str | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """How the log names it: ``shard 3`` for a lane of one shard, ``lane 3 (shards 3, 11, ...)``."""
        if len(self.shards) == 1:
            return f"shard {self.lane}"
        return f"lane {self.lane} (shards {', '.join(map(str, self.shards))})"

    @property
    def single(self) -> bool:
        return any(self.published.get(shard, 0) < seq for shard, seq in self.single_until.items())

    @property
    def unmarked(self) -> dict[int, int]:
        """The shards published further than their database mark says."""
        return {shard: seq for shard, seq in self.published.items() if seq > self.marked.get(shard, 0)}

    def upto(self) -> str:
        if len(self.shards) == 1:
            return str(self.published.get(self.shards[0], 0))
        return ", ".join(f"shard {shard} {seq}" for shard, seq in sorted(self.published.items()))

    def row_name(self, row: Pending) -> str:
        return f"row {row.seq}" if len(self.shards) == 1 else f"row {row.seq} of shard {row.shard}"


class RelayStuck(Exception):
    """A shard's Kafka call did not return long after its timeout: the relay stops."""


class LostLane(Exception):
    """The lane's lease is no longer this relay's."""


def close_publisher(state: Lane) -> None:
    if state.publisher is not None:
        state.publisher.close()
        state.publisher = None
