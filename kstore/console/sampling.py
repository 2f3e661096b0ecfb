"""Sampling every group's lag into the bounded samples table, and drawing it.

A :class:`Sampler` thread reads every group (the console's one :class:`~kstore.ops.lag.LagReader`,
under its lock) every ``console_sample_interval_s`` and writes what it read, for each group and
each of its partitions. The database is asked twice an interval however many groups there are:
one statement reads every group's offsets and dead letters
(:meth:`~kstore.ops.lag.LagReader.read_all`), one writes every group's and partition's sample and
deletes those past their retention (:func:`kstore.db.samples.write`; four on SQLite). Charts are
drawn on the server as SVG: no script, nothing to load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from itertools import pairwise

from markupsafe import Markup, escape

from kstore.db import samples
from kstore.db.store import Store
from kstore.errors import KstoreError
from kstore.ops.lag import GroupReading

log = logging.getLogger(__name__)


#: How long each partition's samples are kept (the group's: ``console_sample_retention_s``): a
#: partition's chart shows its last hour, and a group of 600 partitions sampled every 15 s keeps
#: 144,000 rows for it.
PARTITION_RETENTION = timedelta(hours=1)


def sample_of(reading: GroupReading) -> samples.Sample:
    ages = [p.lag_seconds for p in reading.partitions if p.lag_seconds is not None]
    return samples.Sample(
        group=reading.group, at=datetime.fromtimestamp(reading.at, timezone.utc),
        lag_messages=sum(p.lag_messages for p in reading.partitions),
        lag_seconds=max(ages) if ages else None,
        stored_offsets=sum(p.stored_offset or 0 for p in reading.partitions),
        dead_letters=reading.dead_letters,
        partitions=tuple(samples.PartitionSample(p.topic, p.partition, p.lag_messages, p.stored_offset)
                         for p in reading.partitions),
    )


class Sampler:
    """Takes a sample of every group with stored offsets each ``interval_s``, until :meth:`stop`."""

    def __init__(self, store: Store, read_all: Callable[[], tuple[list[GroupReading], Mapping[str, KstoreError]]],
                 interval_s: float, retention_s: float) -> None:
        self.store, self.read_all = store, read_all
        self.interval_s, self.keep = interval_s, timedelta(seconds=retention_s)
        self.table = samples.build_table(store.settings.table_prefix, store.settings.schema)
        self.partition_table = samples.build_partition_table(store.settings.table_prefix, store.settings.schema)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kstore-console-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def sample_once(self) -> list[samples.Sample]:
        """Read every group and write its sample; a group the brokers cannot answer for now is left out."""
        readings, failed = self.read_all()
        for group, exc in failed.items():
            log.warning("no lag sample of group %r: %s", group, exc)
        taken = [sample_of(reading) for reading in readings]
        samples.write(self.store.engine, self.table, self.partition_table, taken, self.keep,
                      min(self.keep, PARTITION_RETENTION))
        return taken

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # the console serves on without its charts; said once an interval
                log.warning("lag sampling failed: %s: %s", type(exc).__name__, exc)
            self._stop.wait(self.interval_s)

    def history(self, group: str, span: timedelta) -> list[samples.Sample]:
        return samples.read(self.store.engine, self.table, group, datetime.now(timezone.utc) - span)

    def partition_history(self, group: str, topic: str, partition: int) -> list[samples.Sample]:
        """A partition's samples of the last :data:`PARTITION_RETENTION`, as samples of a one-partition
        group (its lag and stored offset; no age, no dead letters), for the same charts."""
        since = datetime.now(timezone.utc) - PARTITION_RETENTION
        return [samples.Sample(group, at, lag, None, stored or 0, 0) for at, lag, stored in
                samples.read_partition(self.store.engine, self.partition_table, group, topic, partition, since)]


def throughput(points: Sequence[samples.Sample]) -> list[tuple[datetime, float]]:
    """Messages a second between each two samples (a reset backwards counts 0, not a negative rate)."""
    rates = []
    for before, after in pairwise(points):
        seconds = (after.at - before.at).total_seconds()
        if seconds > 0:
            rates.append((after.at, max(0, after.stored_offsets - before.stored_offsets) / seconds))
    return rates


WIDTH, HEIGHT, PAD = 640, 160, 36


def svg_chart(title: str, points: Sequence[tuple[datetime, float]], unit: str) -> Markup:
    """A line chart of ``points`` (time, value) as inline SVG, with its last and largest values in the title."""
    label = escape(title)
    if len(points) < 2:
        return Markup(f'<figure class="chart"><figcaption>{label}: not enough samples yet</figcaption></figure>')
    t0, t1 = points[0][0], points[-1][0]
    span = max((t1 - t0).total_seconds(), 1e-9)
    top = max(v for _, v in points)
    scale = top or 1.0  # all zero: a flat line at the bottom
    xy = " ".join(
        f"{PAD + (t - t0).total_seconds() / span * (WIDTH - 2 * PAD):.1f},"
        f"{HEIGHT - PAD / 2 - v / scale * (HEIGHT - PAD):.1f}" for t, v in points
    )
    last = points[-1][1]
    caption = f"{label}: now {last:,.1f} {escape(unit)}, most {top:,.1f} (since {t0:%H:%M:%S} UTC)"
    return Markup(
        f'<figure class="chart"><figcaption>{caption}</figcaption>'
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{label}">'
        f'<line x1="{PAD}" y1="{HEIGHT - PAD / 2}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD / 2}" class="axis"/>'
        f'<text x="2" y="{PAD / 2 + 4}" class="tick">{top:,.0f}</text>'
        f'<text x="2" y="{HEIGHT - PAD / 2}" class="tick">0</text>'
        f'<polyline points="{xy}" class="line"/></svg></figure>'
    )
