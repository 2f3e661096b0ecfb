"""Helpers for kstore's own tests: waiting, worker subprocesses, effects queries."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from kafka import KafkaConsumer, TopicPartition

# Worker subprocesses run here, with this folder on PYTHONPATH: processors are named `processors:Recorder`.
SUPPORT_DIR = Path(__file__).resolve().parent
REPO_DIR = SUPPORT_DIR.parents[1]
#: Their PYTHONPATH: the support folder, then this checkout, so that they run this checkout's kstore
#: even where the environment's installed one (an editable install of another checkout) differs.
SUBPROCESS_PATH = os.pathsep.join([str(SUPPORT_DIR), str(REPO_DIR)])
#: The health server's access log line (kstore.telemetry.health), one per request.
_HTTP_LINE = "kstore.telemetry.health: http: "


def without_kafka_python(folder: Path) -> str:
    """A PYTHONPATH entry (made in ``folder``) under which ``import kafka`` fails as if kafka-python were
    not installed, as in ``pip install kstore``: for the processes a test starts."""
    (folder / "kafka").mkdir(exist_ok=True)
    (folder / "kafka" / "__init__.py").write_text(
        'raise ModuleNotFoundError("kafka-python is not installed here", name="kafka")\n')
    return str(folder)


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class WorkerProcess:
    """A ``kstore worker`` subprocess whose output goes to a log file."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._log_file = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kstore", *self.args],
            cwd=SUPPORT_DIR,
            env={**os.environ, **env, "PYTHONPATH": SUBPROCESS_PATH},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def name(self) -> str:
        """The worker's name, from its first log line (``worker NAME for group ...``)."""
        self.wait_for_log(r"worker \S+ for group")
        found = re.search(r"worker (\S+) for group", self.log)
        assert found is not None
        return found.group(1)

    def wait_for_log(self, pattern: str, timeout: float = 60.0, count: int = 1) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None and len(re.findall(pattern, self.log)) < count:
                raise AssertionError(f"worker exited ({self.proc.returncode}) before logging {pattern!r}:\n{self.log}")
            return len(re.findall(pattern, self.log)) >= count

        wait_until(seen, timeout, what=f"{pattern!r} in the worker log")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the graceful path (finish the batch, leave the group)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> int:
        self.proc.kill()
        return self.wait(30)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"worker did not exit within {timeout}s:\n{self.log[-4000:]}") from None
        self._log_file.close()
        return code

    def cleanup(self) -> None:
        """Kill it if the test left it running, after printing its stacks and log (shown if the test failed)."""
        if self.proc.poll() is None:
            before = len(self.log)
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            self.proc.kill()
            self.proc.wait(30)
            log = self.log
            # What it logged last, then its threads' stacks (the dump SIGUSR1 asked for), each in full
            # enough. A test scraping /metrics makes most lines the health server's access log: left out.
            said = "".join(line for line in log[:before].splitlines(keepends=True) if _HTTP_LINE not in line)
            print(f"--- {self.log_path.name} (killed at teardown) ---\n{said[-8000:]}\n"
                  f"--- its stacks ---\n{log[before:][-8000:]}")
        self._log_file.close()


def effects(dsn: str, table: str = "effects") -> Counter[tuple[str, int, int]]:
    """How many times each (topic, partition, offset) has an effect row."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT topic, partition_id, kafka_offset FROM {table}")).all()
    finally:
        engine.dispose()
    return Counter((r[0], r[1], r[2]) for r in rows)


def stored_offsets(dsn: str, group: str) -> dict[tuple[str, int], int | None]:
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT topic, partition_id, next_offset FROM kstore_offsets WHERE consumer_group = :g"),
                {"g": group},
            ).all()
    finally:
        engine.dispose()
    return {(r[0], r[1]): r[2] for r in rows}


def table_rows(dsn: str, table: str) -> int:
    """How many rows ``table`` (one of kstore's, every group's) holds now."""
    engine = sa.create_engine(dsn)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(sa.table(table))).scalar_one())
    finally:
        engine.dispose()


def outbox_rows(dsn: str) -> int:
    """The rows waiting in kstore's outbox (every group's): 0 once the relays published everything."""
    return table_rows(dsn, "kstore_outbox")


def read_committed(kafka: str, topic: str, timeout: float = 120) -> list[tuple[bytes | None, bytes]]:
    """Every record a read_committed reader sees in ``topic``, up to its last stable offset: (key, value)."""
    return [(r.key, r.value) for r in read_committed_records(kafka, topic, timeout)]


def read_committed_records(kafka: str, topic: str, timeout: float = 120) -> list[Any]:
    """Every record (kafka-python's, with its headers) a read_committed reader sees in ``topic``, up to
    its last stable offset."""
    consumer = KafkaConsumer(bootstrap_servers=kafka, isolation_level="read_committed", enable_auto_commit=False,
                             group_id=None, consumer_timeout_ms=1000)
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"reading {topic} took too long"
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(records)
        return out
    finally:
        consumer.close()


def read_in_flight(hang_file: Path) -> set[tuple[str, int, int]]:
    """The batch a Recorder wrote to ``KSTORE_TEST_HANG_FILE`` before hanging: (topic, partition, offset)."""
    return {(t, int(p), int(o)) for t, p, o in (item.split(":") for item in hang_file.read_text().split(","))}


def assert_exactly_once(counts: Counter[tuple[str, int, int]], expected: set[tuple[str, int, int]]) -> None:
    """Every expected message has exactly one effect, and nothing else has any."""
    doubled = {k: n for k, n in counts.items() if n > 1}
    missing = expected - set(counts)
    extra = set(counts) - expected
    assert not doubled, f"{len(doubled)} messages landed more than once, e.g. {sorted(doubled.items())[:5]}"
    assert not missing, f"{len(missing)} messages never landed, e.g. {sorted(missing)[:5]}"
    assert not extra, f"{len(extra)} unexpected effects, e.g. {sorted(extra)[:5]}"


_TP = re.compile(r"(\S+?)\[(\d+)\]")
_CLAIMED = re.compile(r"(\S+?)\[(\d+)\]@(\w+)")
#: A committed partition in a batch's DEBUG line: ``topic[p]->next_offset@epoch``.
_COMMITTED = re.compile(r"(\S+?)\[(\d+)\]->\d+@(\d+)")


def assert_claimed_before_committed(log: str) -> int:
    """In one worker's DEBUG log: every partition a batch committed was claimed by that worker
    before, and not revoked, lost or fenced since; returns how many partition commits were checked.

    One exception, by design: a revoke or a loss that lands while a batch's last round trip is on
    the wire (after its check that it still holds its partitions) is met by the epoch fence, not
    by the worker. That batch, the next one to commit, may still commit the partition, under the
    epoch this worker held it by (``claim epochs``, then each commit's): the database takes it
    only if no other worker has claimed the partition since."""
    held: dict[tuple[str, int], int | None] = {}
    in_flight: dict[tuple[str, int], int | None] = {}
    checked = 0
    for line in log.splitlines():
        if ": claimed " in line:
            held |= {(t, int(p)): None for t, p, at in _CLAIMED.findall(line.split(": claimed ", 1)[1]) if at != "held"}
        elif ": claim epochs: " in line:
            held |= {(t, int(p)): int(e) for t, p, e in _CLAIMED.findall(line.split(": claim epochs: ", 1)[1])
                     if (t, int(p)) in held}
        elif found := re.search(r"kstore\.engine\.worker: (revoked|lost|fenced) ", line):
            for tp in {(t, int(p)) for t, p in _TP.findall(line.split(": ", 1)[1])}:
                epoch = held.pop(tp, None)
                if found.group(1) != "fenced" and epoch is not None:
                    in_flight[tp] = epoch
        elif re.search(r": committed \d+ messages: ", line):
            done = {(t, int(p)): int(e) for t, p, e in _COMMITTED.findall(line.split(" messages: ", 1)[1])}
            late = {tp: e for tp, e in done.items() if tp not in held and in_flight.get(tp) != e}
            assert not late, f"committed {sorted(late)} without holding their claim: {line}"
            held |= {tp: e for tp, e in done.items() if tp in held}
            in_flight.clear()  # only the batch in flight at the revoke could still commit
            checked += len(done)
    return checked


def with_driver(dsn: str, driver: str) -> str:
    """``dsn`` on another PostgreSQL driver: ``psycopg2`` or ``psycopg`` (psycopg 3)."""
    return sa.engine.make_url(dsn).set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)
