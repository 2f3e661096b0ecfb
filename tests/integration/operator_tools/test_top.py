"""`kstore top`: read in a real pseudo-terminal while a worker comes and goes, and its `--once` frame."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from kstore import Settings
from kstore.db.store import make_engine
from kstore.ops.offsets import set_offsets
from kstore.outbox import Outbox
from tests.support.harness import SUBPROCESS_PATH, SUPPORT_DIR, stored_offsets, wait_until
from tests.support.outbox_backlogs import group_outbox

#: Escape sequences (CSI ... final byte, and the few two-byte ones rich uses), to read the screen as text.
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
HEADER = ["TOPIC", "PARTITION", "STORED", "LOG", "END", "LAG", "LAG", "S", "MSG/S", "1M", "EPOCH", "OWNER", "DEAD"]


class Terminal:
    """`kstore top` on a pseudo-terminal of its own (its controlling terminal: ^C there is SIGINT)."""

    def __init__(self, args: list[str], columns: int = 200, rows: int = 40) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
        env.update(TERM="xterm-256color", PYTHONPATH=str(SUPPORT_DIR))
        pid, fd = pty.fork()
        if pid == 0:  # the child: size the terminal, then become `kstore top`
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
                os.chdir(SUPPORT_DIR)
                os.execve(sys.executable, [sys.executable, "-m", "kstore", "top", *args], env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.output, self.code = pid, fd, "", None

    def read(self, seconds: float = 0.2) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and select.select([self.fd], [], [], left)[0]:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the program exited and the terminal closed
                return
            if not chunk:
                return
            self.output += chunk.decode(errors="replace")

    def frame(self) -> str:
        """The last whole frame on the screen, as plain text (rich redraws the live table in place)."""
        self.read()
        text = ANSI.sub("", self.output).replace("\r", "")
        frames = [f for f in text.split("kstore top  group")[1:] if re.search(r"\n\d+ partitions", f)]
        return "kstore top  group" + frames[-1] if frames else ""

    def wait_for(self, pattern: str, timeout: float = 30) -> str:
        def shown() -> str | None:
            frame = self.frame()
            return frame if re.search(pattern, frame) else None

        try:
            return str(wait_until(shown, timeout, what=f"{pattern!r} on the screen"))
        except AssertionError:
            raise AssertionError(f"{pattern!r} never shown; screen:\n{ANSI.sub('', self.output)[-3000:]}") from None

    def ctrl_c(self) -> int:
        os.write(self.fd, b"\x03")
        return self.wait()

    def wait(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
                return self.code
        raise AssertionError(f"kstore top did not exit; screen:\n{ANSI.sub('', self.output)[-3000:]}")

    def close(self) -> None:
        if self.code is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture
def terminal() -> Iterator[Any]:
    opened: list[Terminal] = []

    def open_terminal(*args: str) -> Terminal:
        opened.append(Terminal(list(args)))
        return opened[-1]

    yield open_terminal
    for t in opened:
        t.close()


def rows(frame: str, topic: str) -> dict[int, list[str]]:
    """Table rows by partition: the cells after the topic (an empty owner cell merges into the spaces)."""
    out = {}
    for line in frame.splitlines():
        cells = line.split()
        if cells[:1] == [topic]:
            out[int(cells[1])] = cells[1:]
    return out


def test_top_in_a_terminal_follows_a_worker_coming_and_going(pg_dsn: str, kafka: str, new_topic: Any,
                                                              produce: Any, workers: Any, terminal: Any,
                                                              tmp_path: Path) -> None:
    topic, group = new_topic(partitions=2), "watched"
    produce(topic, (f"a{i}" for i in range(20)), partition=0)
    produce(topic, (f"b{i}" for i in range(10)), partition=1)
    pause = tmp_path / "pause"
    pause.touch()  # the worker claims its partitions, then holds its first batch until this goes
    w = workers(pg_dsn, topic, group, env={"KSTORE_TEST_PAUSE_FILE": str(pause)})
    wait_until(lambda: Path(f"{pause}.batch").exists(), 60, what="the worker's first batch")

    top = terminal("--group", group, "--dsn", pg_dsn, "--bootstrap-servers", kafka, "--interval", "0.5")
    owner = re.escape(w.name)  # as in its log lines and the database
    frame = top.wait_for(owner)
    assert frame.startswith(f"kstore top  group {group}"), frame
    assert " lag 30 messages" in frame and "dead letters waiting 0" in frame, frame
    assert any(line.split() == HEADER for line in frame.splitlines()), frame
    table = rows(frame, topic)
    assert set(table) == {0, 1}, frame
    # PARTITION, STORED, LOG END, LAG, LAG S, MSG/S 1M, EPOCH, OWNER, DEAD
    assert [table[0][i] for i in (2, 3)] == ["20", "20"] and [table[1][i] for i in (2, 3)] == ["10", "10"], frame
    assert all(float(table[p][4]) > 0 for p in (0, 1)), frame
    assert all(re.fullmatch(owner, table[p][7]) for p in (0, 1)), frame

    pause.unlink()  # the worker catches up: lag 0 and a throughput, the owner still there
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 20, (topic, 1): 10}, 60)
    frame = top.wait_for(r" lag 0 messages")
    table = rows(frame, topic)
    assert [table[p][3:5] for p in (0, 1)] == [["0", "0.0"], ["0", "0.0"]], frame
    assert [table[p][1] for p in (0, 1)] == ["20", "10"], frame
    assert float(table[0][5]) > 0, f"partition 0 moved 20 offsets in the last minute:\n{frame}"
    assert all(re.fullmatch(owner, table[p][7]) for p in (0, 1)), frame

    assert w.terminate() == 0  # the worker leaves: the owner cell goes blank, the view carries on
    frame = top.wait_for(rf"(?m)^ *{topic} +0 +20 +20 +0 +0\.0 +\S+ +\d+ +0\s*$")
    assert not re.search(owner, frame), frame
    assert top.ctrl_c() == 0


def test_top_says_when_the_database_is_down_and_keeps_retrying(terminal: Any) -> None:
    # A port nobody listens on, held (bound, never listening) for the whole test so that no
    # other process can take it meanwhile: connecting to it is refused.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        top = terminal("--group", "g", "--dsn", f"postgresql+psycopg2://kstore@127.0.0.1:{port}/kstore",
                       "--interval", "0.5")
        deadline = time.monotonic() + 30
        while top.output.count("cannot read the database") < 2 and time.monotonic() < deadline:
            top.read()
        screen = " ".join(ANSI.sub("", top.output).split())  # the line wraps at the terminal's width
        assert screen.count("cannot read the database") >= 2, f"shown again at each refresh:\n{screen}"
        assert "Connection refused" in screen and "(retrying every 0.5s)" in screen, screen
        assert top.ctrl_c() == 0


def test_top_once_prints_one_frame(pg_dsn: str, kafka: str, new_topic: Any, produce: Any, workers: Any) -> None:
    topic, group = new_topic(partitions=2), "glimpsed"
    produce(topic, (f"a{i}" for i in range(8)), partition=0)
    w = workers(pg_dsn, topic, group)
    wait_until(lambda: stored_offsets(pg_dsn, group) == {(topic, 0): 8, (topic, 1): 0}, 60)
    assert w.terminate() == 0
    produce(topic, ["late"] * 3, partition=1)

    args = ["top", "--group", group, "--once", "--dsn", pg_dsn, "--bootstrap-servers", kafka]
    done = subprocess.run([sys.executable, "-m", "kstore", *args], capture_output=True, text=True, timeout=60,
                          cwd=SUPPORT_DIR)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout, "no escape codes when not on a terminal"
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"kstore top  group {group}  at ") and " lag 3 messages" in lines[0], done.stdout
    assert lines[1].split() == HEADER, done.stdout
    table = rows(done.stdout, topic)
    # No worker: no owner (the cell is blank), no throughput yet in a single frame.
    assert table[0][:6] == ["0", "8", "8", "0", "0.0", "-"] and table[0][7:] == ["0"], done.stdout
    assert table[1][:4] == ["1", "0", "3", "3"] and float(table[1][4]) > 0, done.stdout
    assert lines[-1] == "2 partitions", done.stdout

    unreachable = subprocess.run([sys.executable, "-m", "kstore", *args[:-2], "--bootstrap-servers", kafka,
                                  "--dsn", "postgresql+psycopg2://kstore@127.0.0.1:1/kstore"],
                                 capture_output=True, text=True, timeout=60, cwd=SUPPORT_DIR)
    assert unreachable.returncode == 2 and unreachable.stderr.startswith("kstore: error: cannot connect"), unreachable


def test_top_once_shows_a_line_for_each_applications_outbox(pg_dsn: str, kafka: str, new_topic: Any) -> None:
    """Outboxes no group with stored offsets has (applications'), each with its records waiting and the
    oldest's age; the group's own outbox is not one of them."""
    topic, group = new_topic(partitions=1), "beside-the-shop"
    settings = Settings(dsn=pg_dsn, bootstrap_servers=kafka)
    set_offsets(settings, group, topic, to_earliest=True, execute=True, reason="a stored offset")
    engine = make_engine(settings)
    group_outbox(engine, group, shards=2)
    Outbox("idle-app", settings, shards=2).setup(engine)
    events = Outbox("shop-web", settings, shards=4)
    written = time.time()
    with Session(engine) as session, session.begin():
        for n in range(3):
            events.produce(session, "orders", {"n": n}, key=f"k{n}")
    engine.dispose()
    time.sleep(1.0)

    done = subprocess.run([sys.executable, "-m", "kstore", "top", "--group", group, "--once", "--dsn", pg_dsn,
                           "--bootstrap-servers", kafka], capture_output=True, text=True, timeout=60, cwd=SUPPORT_DIR,
                          env={**os.environ, "PYTHONPATH": SUBPROCESS_PATH})
    shown = time.time()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    outboxes = [line for line in lines if line.startswith("outbox")]
    assert len(outboxes) == 2 and outboxes[0] == "outbox idle-app  0 records waiting, oldest 0.0s", done.stdout
    found = re.fullmatch(r"outbox shop-web  3 records waiting, oldest (\d+\.\d)s", outboxes[1])
    assert found and 1.0 <= float(found.group(1)) <= shown - written + 0.1, done.stdout
    assert lines.index(outboxes[0]) == 1 and lines[3].split() == HEADER, "under the summary, above the table"
