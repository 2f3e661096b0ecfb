"""``kstore top``: a live terminal view of one group, refreshed every second.

Per partition: the stored offset, the log end, the lag in messages and in seconds
(:mod:`kstore.ops.lag`), the live owner and epoch, the throughput over the last minute
(from the stored offset's movement between refreshes) and the dead letters
waiting. Once the group's processor has produced records (``Processor.produce``), a
line about its outbox: records waiting to be published, the oldest's age, the shards
a relay holds; and a line for each application's outbox in the database (:class:`kstore.outbox.Outbox`,
an outbox no group with stored offsets has): its records waiting and the oldest's age, read in the
same visit to the database. Workers may come and go (a partition nobody holds has a blank owner);
while the database or the brokers cannot be read, a line says so above the last
table read, and every refresh tries again.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kstore.errors import BrokerError, DatabaseError, KstoreError
from kstore.relay.tables import Backlog
from kstore.settings import Settings
from kstore.types import TopicPartition as TP

from .lag import GroupReading, LagReader
from .offsets import check_group_known

#: Throughput is the stored offsets' movement over this many seconds.
THROUGHPUT_WINDOW_S = 60.0
#: ``--once`` to a file or a pipe: the table is as wide as its content, up to this.
PIPE_WIDTH = 240


class Throughput:
    """Messages committed per second per partition over the last ``window_s``, from stored offsets seen over time."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[TP, deque[tuple[float, int]]] = {}

    def update(self, at: float, offsets: Mapping[TP, int | None]) -> None:
        for tp, offset in offsets.items():
            if offset is None:
                continue
            seen = self._seen.setdefault(tp, deque())
            if seen and offset < seen[-1][1]:
                seen.clear()  # reset backwards by an operator: a replay is not negative throughput
            seen.append((at, offset))
            while len(seen) > 2 and at - seen[1][0] >= self.window_s:
                seen.popleft()  # keep the newest sample at least window_s old, so the rate spans the full window

    def rate(self, tp: TP) -> float | None:
        """Messages per second, or None until two readings are apart."""
        seen = self._seen.get(tp)
        if not seen or len(seen) < 2 or seen[-1][0] <= seen[0][0]:
            return None
        (t0, o0), (t1, o1) = seen[0], seen[-1]
        return (o1 - o0) / (t1 - t0)


class Top:
    """The view of one group; :meth:`run` until :meth:`request_stop`, or :meth:`print_once`."""

    def __init__(self, settings: Settings, group: str, interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.group, self.interval, self.clock = settings, group, interval, clock
        self.reader = LagReader(settings, owners=True, outbox=True, applications=True)
        self.throughput = Throughput()
        self.last: GroupReading | None = None
        #: Why the last refresh failed (None: it did not).
        self.problem: str | None = None
        self._stop = threading.Event()

    def refresh(self) -> None:
        """Read the group again; a failure is kept in :attr:`problem` (the next refresh retries)."""
        try:
            reading = self.reader.read(self.group)
            if not reading.partitions:
                check_group_known(self.settings, self.group)
        except (DatabaseError, BrokerError) as exc:
            what = "the database" if isinstance(exc, DatabaseError) else "the Kafka brokers"
            self.problem = f"cannot read {what}: {exc}"
            return
        except KstoreError as exc:
            self.problem = str(exc)
            return
        except Exception as exc:  # keep the view up; the next refresh starts with fresh connections
            self.reader.reset()
            self.problem = f"unexpected error: {type(exc).__name__}: {exc}"
            return
        self.problem, self.last = None, reading
        self.throughput.update(self.clock(), {(p.topic, p.partition): p.stored_offset for p in reading.partitions})

    def render(self) -> RenderableType:
        """The frame: a summary line, the outbox's if the group has one, a line per application's outbox, a line
        about a failure if any, the table."""
        parts: list[RenderableType] = [self._summary()]
        if self.last is not None and any(s.next_seq > 1 for s in self.last.outbox):  # it has produced
            parts.append(outbox_line(self.last))
        if self.last is not None:
            parts += [application_line(b, self.last.at) for b in self.last.applications]
        if self.problem is not None:
            parts.append(Text(f"{self.problem} (retrying every {self.interval:g}s)", style="bold red"))
        if self.last is not None:
            stale = " (last read; see above)" if self.problem is not None else ""
            parts += [self._table(self.last), Text(f"{len(self.last.partitions)} partitions{stale}")]
        return Group(*parts)

    def run(self, console: Console | None = None) -> None:
        """Refresh every ``interval`` seconds until :meth:`request_stop`; the last frame stays on screen.
        A group with no stored offsets (a typo, most likely) is said above an empty table, and watched for."""
        try:
            self.refresh()
            with Live(self.render(), console=console, auto_refresh=False, transient=False) as live:
                while not self._stop.wait(self.interval):
                    self.refresh()
                    live.update(self.render(), refresh=True)
        finally:
            self.reader.close()

    def print_once(self, console: Console | None = None) -> None:
        """Print one frame; a database or broker failure raises (for scripts: one line, exit 2)."""
        if console is None:  # to a file or a pipe, not the 80 columns rich assumes there
            console = Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)
        try:
            check_group_known(self.settings, self.group)
            self.last = self.reader.read(self.group)
        finally:
            self.reader.close()
        console.print(self.render())

    def request_stop(self) -> None:
        """Stop after the refresh in progress (safe from a signal handler)."""
        self._stop.set()

    def _summary(self) -> Text:
        text = Text.assemble(("kstore top", "bold"), "  group ", (self.group, "bold cyan"))
        if self.last is None:
            return text
        at = datetime.fromtimestamp(self.last.at).strftime("%H:%M:%S")
        parts = self.last.partitions
        oldest = max((p.lag_seconds for p in parts if p.lag_seconds is not None), default=0.0)
        text.append(f"  at {at}  lag {sum(p.lag_messages for p in parts)} messages, oldest {oldest:.1f}s"
                    f"  dead letters waiting {self.last.dead_letters}")
        return text

    def _table(self, reading: GroupReading) -> Table:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        table.add_column("TOPIC")
        for name in ("PARTITION", "STORED", "LOG END", "LAG", "LAG S", "MSG/S 1M", "EPOCH"):
            table.add_column(name, justify="right")
        table.add_column("OWNER")
        table.add_column("DEAD", justify="right")
        for p in reading.partitions:
            rate = self.throughput.rate((p.topic, p.partition))
            table.add_row(
                p.topic, str(p.partition), _or_dash(p.stored_offset), str(p.log_end),
                Text(str(p.lag_messages), style="yellow" if p.lag_messages else ""),
                "-" if p.lag_seconds is None else f"{p.lag_seconds:.1f}",
                "-" if rate is None else f"{rate:.1f}", _or_dash(p.epoch), p.owner or "",
                Text(str(p.dead_letters), style="red" if p.dead_letters else ""),
            )
        return table


def outbox_line(reading: GroupReading) -> Text:
    """Records the group produced and its relays have not yet published, the oldest's age, the shards held."""
    shards = reading.outbox
    waiting = sum(s.waiting for s in shards)
    stamps = [s.oldest if s.oldest.tzinfo else s.oldest.replace(tzinfo=timezone.utc)  # SQLite's are naive UTC
              for s in shards if s.oldest is not None]
    age = max(0.0, reading.at - min(stamps).timestamp()) if stamps else 0.0
    held = sum(1 for s in shards if s.owner is not None and s.lease_left_s > 0)
    return Text.assemble(("outbox", "bold"), "  ", (f"{waiting} records waiting", "yellow" if waiting else ""),
                         f", oldest {age:.1f}s  shards held by a relay {held}/{len(shards)}")


def application_line(backlog: Backlog, at: float) -> Text:
    """An application's outbox: its records not yet published and the oldest's age, as of ``at``."""
    age = backlog.age_s(datetime.fromtimestamp(at, timezone.utc))
    waiting = backlog.waiting
    return Text.assemble(("outbox ", "bold"), (backlog.name, "bold cyan"), "  ",
                         (f"{waiting} records waiting", "yellow" if waiting else ""), f", oldest {age:.1f}s")


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
