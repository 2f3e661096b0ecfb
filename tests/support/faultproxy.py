"""A fault-injecting TCP proxy for the tests: commits in doubt, mid-transaction cuts, latency, partitions.

Put it between a client (a ``kstore worker``, an SQLAlchemy engine) and PostgreSQL or Kafka, then arm
a fault from the test thread::

    with FaultProxy(host, port) as proxy:
        worker = workers(proxy.dsn_through(pg_dsn), ...)
        proxy.cut_after_commit()          # the next COMMIT lands, but its answer never arrives

One background thread runs a selector loop over every connection, so faults are decided in one place,
in the order bytes actually flow, and closing a connection never races a thread blocked in ``recv``.
For PostgreSQL the proxy follows the wire protocol (frontend and backend message framing) just enough
to find COMMITs, transaction state and the end of each answer; with ``protocol="raw"`` (Kafka) it only
moves bytes, and the protocol-aware faults are refused.

Caveats:
- Arm the PostgreSQL faults after the engine has connected once: SQLAlchemy's first-connect queries
  run inside a transaction and would take a mid-transaction cut.
- If the server accepts TLS/GSS encryption the watcher cannot read the stream and those faults never
  fire there (the event log says so). The test servers have ``ssl = off``; ``sslmode=disable`` is safe.
- Kafka: a client connects to the brokers' advertised addresses after bootstrapping, bypassing the
  proxy, unless the broker advertises the proxy's address (one proxy per broker).
- Upstream connects are blocking, in the loop thread: fine for local targets only.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from sqlalchemy.engine import make_url

T = TypeVar("T")

#: Request codes of the untyped messages a PostgreSQL client may send before its StartupMessage; the
#: server answers each with one byte ('N' = no, go on in clear text).
_ENCRYPTION_REQUESTS = {80877103: "SSLRequest", 80877104: "GSSENCRequest"}
_COMMITS = {"COMMIT", "END"}
_TRANSACTION_ENDS = _COMMITS | {"ROLLBACK", "ABORT"}


def _first_and_last(sql: str) -> tuple[list[str], str]:
    """A simple-query message's words, and its last statement, upper-cased."""
    text = sql.strip().rstrip(";").upper()
    return text.split(), text.rsplit(";", 1)[-1].strip()


def _commit_kind(sql: str) -> str | None:
    """How a simple-query message commits, if it does: a COMMIT, or statements ending with one
    (kstore's one-round-trip commit, kstore.db.store, is one message: "<compare-and-set>; COMMIT")."""
    words, last = _first_and_last(sql)
    first = words[0] if words else ""
    if first in _COMMITS:
        return "COMMIT" if words[1:2] != ["PREPARED"] else None
    return "COMMIT (after the statements before it in one message)" if last in _COMMITS else None
#: Stop reading a socket while this much of its data waits in the proxy (backpressure).
_MAX_HELD = 1 << 20


def _frame(buf: bytearray, typed: bool) -> tuple[bytes, bytes, bytes] | None:
    """Take one whole message off ``buf``: (type byte or b"", body, raw bytes); None until it is complete.

    PostgreSQL messages are a type byte and a big-endian int32 length that counts itself but not the
    type byte; the messages before the StartupMessage have no type byte. TCP splits and merges them
    freely, hence the buffer.
    """
    head = 5 if typed else 4
    if len(buf) < head:
        return None
    (length,) = struct.unpack_from(">I", buf, head - 4)
    if length < 4 or length > 1 << 30:
        raise ValueError(f"implausible message length {length}")
    end = head - 4 + length
    if len(buf) < end:
        return None
    raw = bytes(buf[:end])
    del buf[:end]
    return raw[:1] if typed else b"", raw[head:], raw


class PgWatcher:
    """Follows one PostgreSQL connection in both directions and decides which answer to withhold and cut.

    Sans-IO: the proxy shows it client bytes before they go to the server, and server bytes before they
    go to the client. Only the simple query protocol is understood (psycopg2 uses nothing else). Each
    Query, Sync or FunctionCall is answered by exactly one ReadyForQuery, in order, so a queue of
    "what to do at that ReadyForQuery" pairs answers with requests. If encryption is negotiated or the
    stream makes no sense the watcher goes ``opaque``: bytes still flow, faults just cannot fire there.
    """

    def __init__(self, take: Callable[[str, Sequence[str]], bool], log: Callable[[str], None],
                 seen: Callable[[str], None] = lambda sql: None) -> None:
        # take("commit", statements) / take("transaction", ...): consume one armed fault, if any (a
        # commit fault may want a transaction that touched a given table: the statements say).
        self._take = take
        self._log = log
        self._seen = seen  # every simple-query message's text, in the order sent
        self._client = bytearray()
        self._server = bytearray()
        self._client_typed = False  # every frontend message after the StartupMessage has a type byte
        self._owed_bytes = 0  # one-byte answers the server owes to encryption requests
        self._pending: collections.deque[str | None] = collections.deque()
        self._status = b"I"  # transaction status from the last ReadyForQuery: I(dle), T(ransaction), E(rror)
        self._tag = ""  # the last CommandComplete tag, for the event log
        self.opaque = False
        #: What the client sent in its current transaction: each statement's text (simple queries and
        #: the extended protocol's Parse), and "<CopyData>" for the data of a COPY ... FROM STDIN.
        self.transaction: list[str] = []
        #: ``transaction`` as it was when its COMMIT was cut (the last one cut on this connection).
        self.cut_transaction: list[str] = []
        #: The armed kinds ("commit", "transaction") this connection took and has not fired yet, oldest
        #: first: a connection that closes before the answer comes gives them back to the proxy.
        self.unfired: list[str] = []

    def _give_up(self, why: str) -> None:
        self.opaque = True
        self._client.clear()
        self._server.clear()
        self._log(f"stops following the protocol: {why}")

    def client(self, data: bytes) -> str | None:
        """See bytes on their way to the server: forwarded as they are, unless this returns why the
        connection is cut now instead (a COMMIT that must never reach the server)."""
        if self.opaque:
            return None
        self._client += data
        try:
            while not self.opaque and (msg := _frame(self._client, self._client_typed)) is not None:
                kind, body, _ = msg
                if not self._client_typed:
                    self._untyped(body)
                elif kind == b"Q" and (cut := self._query(body.rstrip(b"\0").decode(errors="replace"))):
                    return cut
                elif kind == b"P":  # Parse: statement name, NUL, query text, NUL, parameter types
                    self.transaction.append(body.partition(b"\0")[2].partition(b"\0")[0].decode(errors="replace"))
                elif kind == b"d" and self.transaction[-1:] != ["<CopyData>"]:
                    self.transaction.append("<CopyData>")
                elif kind in (b"S", b"F"):
                    self._pending.append(None)
        except ValueError as e:
            self._give_up(f"client: {e}")
        return None

    def _untyped(self, body: bytes) -> None:
        """The StartupMessage, or an encryption request before it (answered by one untyped byte)."""
        (code,) = struct.unpack_from(">I", body) if len(body) >= 4 else (0,)
        if code in _ENCRYPTION_REQUESTS:
            self._owed_bytes += 1
            self._log(f"client sent {_ENCRYPTION_REQUESTS[code]}")
        else:
            self._client_typed = True

    def _query(self, sql: str) -> str | None:
        """A simple query on its way: why to cut before it reaches the server, or None (sent)."""
        self._seen(sql)
        self.transaction.append(sql)
        if _commit_kind(sql) is not None and self._take("commit_refused", self.transaction):
            self.cut_transaction = list(self.transaction)
            return f"cut before COMMIT: never sent ({sql[-40:]!r})"
        self._pending.append(self._fault_for(sql))
        return None

    def _fault_for(self, sql: str) -> str | None:
        """What to do at the answer to ``sql``: nothing (None), or cut the connection, as an armed fault says."""
        kind = _commit_kind(sql)
        if kind is not None and self._take("commit", self.transaction):
            self.unfired.append("commit")
            return kind
        words, last = _first_and_last(sql)
        ends = (words[0] if words else "") in _TRANSACTION_ENDS or last in _TRANSACTION_ENDS
        if self._status == b"T" and not ends and self._take("transaction", self.transaction):
            self.unfired.append("transaction")
            return f"statement in a transaction ({sql[:40]!r})"
        return None

    def server(self, data: bytes) -> tuple[bytes, str | None]:
        """Bytes from the server: (what may reach the client, why to cut the connection now or None)."""
        if self.opaque:
            return data, None
        self._server += data
        out = bytearray()
        try:
            while (msg := self._next_server_message(out)) is not None:
                kind, body, raw = msg
                fault = self._pending[0] if self._pending else None
                if fault is None:
                    out += raw  # otherwise withheld: the answer to a statement whose connection gets cut
                if kind == b"C":
                    self._tag = body.rstrip(b"\0").decode(errors="replace")
                elif kind == b"Z":
                    self._ready_for_query(body[:1], fault)
                    if fault is not None:
                        del self.unfired[0]
                        return bytes(out), f"cut after {fault}: the server answered {self._tag!r}"
        except ValueError as e:
            out += self._server
            self._give_up(f"server: {e}")
        return bytes(out), None

    def _ready_for_query(self, status: bytes, fault: str | None) -> None:
        self._status = status
        if self._pending:
            self._pending.popleft()
        if fault is not None:
            self.cut_transaction = list(self.transaction)
        if status == b"I":  # outside a transaction: the next statement begins one
            self.transaction.clear()

    def _next_server_message(self, out: bytearray) -> tuple[bytes, bytes, bytes] | None:
        """The next whole backend message, after passing on (into ``out``) the one-byte encryption answers."""
        while self._owed_bytes and self._server and not self.opaque:
            answer = bytes(self._server[:1])
            del self._server[:1]
            out += answer
            self._owed_bytes -= 1
            if answer != b"N":  # 'S' or 'G': what follows is encrypted
                out += self._server
                self._give_up(f"server accepted encryption ({answer!r})")
        if self._owed_bytes or self.opaque:
            return None
        return _frame(self._server, typed=True)


class _Half:
    """One direction of a connection: bytes read from ``src``, held for the latency, then written to ``dst``."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.delayed: collections.deque[tuple[float, bytes]] = collections.deque()  # (when due, chunk)
        self.out = bytearray()  # processed, waiting for ``dst`` to accept it
        self.eof = False

    def held(self) -> int:
        return len(self.out) + sum(len(chunk) for _, chunk in self.delayed)


class _Conn:
    def __init__(self, cid: int, client: socket.socket, server: socket.socket, watcher: PgWatcher | None) -> None:
        self.cid = cid
        self.up = _Half(client, server)
        self.down = _Half(server, client)
        self.watcher = watcher
        self.closed = False


class FaultProxy:
    """A TCP proxy on 127.0.0.1 whose faults are armed at run time, thread-safely, from the test thread.

    All state belongs to the loop thread; the control methods hand it a function and wait until it ran,
    so when ``blackhole()`` returns nothing more gets through, and when ``cut_all()`` returns every
    connection is gone. Counters and ``events`` may be read from any thread.
    """

    def __init__(self, target_host: str, target_port: int, *, protocol: Literal["postgres", "raw"] = "postgres",
                 recv_size: int = 65536) -> None:
        self.target = (target_host, target_port)
        self.protocol = protocol
        self.recv_size = recv_size  # small values split every message, to exercise the framing
        self.commits_cut = 0
        #: COMMITs the proxy never let reach the server (``cut_before_commit``).
        self.commits_refused = 0
        self.transactions_cut = 0
        self.cuts = 0  # connections closed by a fault, commit and mid-transaction cuts included
        self.connections_seen = 0
        self.events: list[str] = []
        #: (connection number, text) of every simple-query message clients sent through the proxy.
        self.queries: list[tuple[int, str]] = []
        #: Bytes received from clients, counted when they arrive (before any latency holds them).
        self.client_bytes = 0
        #: For each COMMIT cut, what its transaction sent (``PgWatcher.transaction``), in the order cut.
        self.cut_transactions: list[list[str]] = []
        #: The same for each COMMIT refused (``cut_before_commit``).
        self.refused_transactions: list[list[str]] = []
        self._armed = {"commit": 0, "transaction": 0, "commit_refused": 0}
        self._commit_touching: str | None = None
        self._latency = 0.0
        self._blackholed = False
        self._heal_at: float | None = None
        self._conns: dict[int, _Conn] = {}
        self._masks: dict[socket.socket, int] = {}
        self._sel = selectors.DefaultSelector()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener: socket.socket | None = None
        self._port = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._t0 = time.monotonic()

    # --- life cycle ---------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, lambda _: self._wake_r.recv(4096))
        self._thread = threading.Thread(target=self._run, name=f"faultproxy:{self.port}", daemon=True)
        self._thread.start()
        self._log(f"listening on {self.address}, forwarding to {self.target[0]}:{self.target[1]}")
        return self

    def stop(self) -> None:
        """Close the listener and every connection (a plain close, not a fault)."""
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        else:  # never started: the loop did not get to close these
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._port, "start() the proxy first"
        return self._port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def dsn_through(self, dsn: str) -> str:
        """The SQLAlchemy URL ``dsn`` with its host and port replaced by the proxy's."""
        url = make_url(dsn).difference_update_query(["host", "port"])
        return url.set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    # --- faults ---------------------------------------------------------------------------------------

    def cut_after_commit(self, count: int = 1, touching: str | None = None) -> None:
        """The next ``count`` COMMITs reach the server; once its answer is back, both sockets are reset
        and the answer is dropped: the client cannot know the commit landed (a commit in doubt).
        ``touching``: only COMMITs of transactions with a statement that names it (a table, say)."""
        self._commit_touching = touching
        self._arm("commit", count)

    def cut_before_commit(self, count: int = 1) -> None:
        """The next ``count`` COMMITs never reach the server: the connection is reset instead of
        sending them (with whatever else their chunk held), so the server rolls the transaction back
        while the client's COMMIT fails as after a lost answer (a commit in doubt that did not land)."""
        self._arm("commit_refused", count)

    def cut_mid_transaction(self, count: int = 1) -> None:
        """The next ``count`` statements sent inside a transaction reach the server and run; once their
        answer is back, the connection is reset instead, so the server rolls the transaction back."""
        self._arm("transaction", count)

    def latency(self, seconds: float) -> None:
        """Delay every chunk, both ways, by ``seconds`` (a round trip by twice that); 0 turns it off."""
        self._call(lambda: setattr(self, "_latency", max(0.0, seconds)))
        self._log(f"latency {seconds}s")

    def blackhole(self) -> None:
        """A partition: stop reading, writing and accepting, on every connection, without closing any.

        What was read already stays held and is delivered by ``heal()``, as a healed network delivers
        retransmissions. The proxy's kernel still ACKs what fits in its receive buffers and answers TCP
        keepalives, so keepalives on the client or server do NOT detect this partition; only
        application timeouts (or a full send buffer with TCP_USER_TIMEOUT) can.
        """
        self._call(lambda: self._set_blackhole(True, None))

    def blackhole_for(self, seconds: float) -> None:
        """``blackhole()`` now, ``heal()`` by itself after ``seconds``."""
        self._call(lambda: self._set_blackhole(True, time.monotonic() + seconds))

    def heal(self) -> None:
        self._call(lambda: self._set_blackhole(False, None))

    def cut_all(self) -> int:
        """Reset (RST, via SO_LINGER 0) every current connection at once; returns how many."""
        return self._call(self._cut_all)

    # --- internals: run by the loop thread -------------------------------------------------------------

    def _log(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._t0:8.3f}s {text}")

    def _arm(self, kind: str, count: int) -> None:
        if self.protocol != "postgres":
            raise ValueError(f"{kind} faults need protocol='postgres'")
        self._call(lambda: self._armed.__setitem__(kind, self._armed[kind] + count))
        self._log(f"armed {count} {kind} cut(s)")

    def _take(self, kind: str, statements: Sequence[str] = ()) -> bool:
        if self._armed[kind] <= 0:
            return False
        touching = self._commit_touching
        if kind == "commit" and touching is not None and not any(touching in sql for sql in statements):
            return False
        self._armed[kind] -= 1
        return True

    def _set_blackhole(self, on: bool, heal_at: float | None) -> None:
        self._blackholed, self._heal_at = on, heal_at
        if not on:
            self._log("healed")
        else:
            self._log("blackhole" + (f" for {heal_at - time.monotonic():.2f}s" if heal_at is not None else ""))

    def _cut_all(self) -> int:
        conns = list(self._conns.values())
        for conn in conns:
            self._close(conn, "cut_all", reset=True)
        self.cuts += len(conns)
        return len(conns)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # the pipe is full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the loop thread (or here, if the loop is not running) and return its result."""
        if self._thread is None or not self._thread.is_alive():
            return fn()
        result: list[Any] = []
        done = threading.Event()
        self._commands.put((fn, result, done))
        self._wake()
        if not done.wait(10):
            raise RuntimeError("the proxy loop did not answer within 10 s")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]  # type: ignore[no-any-return]

    def _run_commands(self) -> None:
        while not self._commands.empty():
            fn, result, done = self._commands.get()
            try:
                result.append(fn())
            except BaseException as e:  # handed back to the caller
                result.append(e)
            done.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                now = time.monotonic()
                if self._heal_at is not None and now >= self._heal_at:
                    self._set_blackhole(False, None)
                if not self._blackholed:
                    for conn in list(self._conns.values()):
                        self._pump(conn, now)
                self._update_interest()
                for key, mask in self._sel.select(self._timeout(now)):
                    key.data(mask)
        except Exception as e:  # keep the reason in the log the test can print
            self._log(f"loop crashed: {e!r}")
            raise
        finally:
            for conn in list(self._conns.values()):
                self._close(conn, "proxy stopped", reset=False)
            self._run_commands()
            self._sel.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                if sock is not None:
                    sock.close()

    def _timeout(self, now: float) -> float | None:
        dues = [] if self._blackholed else [h.delayed[0][0] for c in self._conns.values()
                                             for h in (c.up, c.down) if h.delayed]
        if self._heal_at is not None:
            dues.append(self._heal_at)
        return max(0.0, min(dues) - now) if dues else None

    def _update_interest(self) -> None:
        """(Un)register sockets for what they should wait for now: nothing at all during a blackhole."""
        want: dict[socket.socket, tuple[int, Callable[[int], None]]] = {}
        if self._listener is not None and not self._blackholed:
            want[self._listener] = (selectors.EVENT_READ, self._accept)
        for conn in [] if self._blackholed else self._conns.values():
            for half in (conn.up, conn.down):
                if not half.eof and half.held() < _MAX_HELD:
                    self._want(want, conn, half.src, selectors.EVENT_READ)
                if half.out:
                    self._want(want, conn, half.dst, selectors.EVENT_WRITE)
        for sock in [s for s in self._masks if s not in want]:
            self._sel.unregister(sock)
            del self._masks[sock]
        for sock, (mask, callback) in want.items():
            if sock not in self._masks:
                self._sel.register(sock, mask, callback)
            elif self._masks[sock] != mask:
                self._sel.modify(sock, mask, callback)
            self._masks[sock] = mask

    def _want(self, want: dict[socket.socket, tuple[int, Callable[[int], None]]], conn: _Conn,
              sock: socket.socket, event: int) -> None:
        mask = want[sock][0] if sock in want else 0
        want[sock] = (mask | event, lambda m: self._io(conn, sock, m))

    def _accept(self, _mask: int) -> None:
        assert self._listener is not None
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.connections_seen += 1
        cid = self.connections_seen
        try:  # blocking, in the loop: the targets are local, so this takes microseconds
            server = socket.create_connection(self.target, timeout=5)
        except OSError as e:
            self._log(f"conn#{cid} cannot reach the target: {e}")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        watcher = None
        if self.protocol == "postgres":
            watcher = PgWatcher(self._take, lambda text: self._log(f"conn#{cid} {text}"),
                                lambda sql: self.queries.append((cid, sql)))
        self._conns[cid] = _Conn(cid, client, server, watcher)
        self._log(f"conn#{cid} opened")

    def _io(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        """Read what ``sock`` has (stamped with its due time), or write what waits for it."""
        if conn.closed:
            return
        try:
            if mask & selectors.EVENT_READ:
                half = conn.up if sock is conn.up.src else conn.down
                chunk = sock.recv(self.recv_size)
                if chunk:
                    if half is conn.up:
                        self.client_bytes += len(chunk)
                    half.delayed.append((time.monotonic() + self._latency, chunk))
                else:
                    half.eof = True
            if mask & selectors.EVENT_WRITE:
                half = conn.up if sock is conn.up.dst else conn.down
                del half.out[:sock.send(half.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self._close(conn, f"reset ({e})", reset=True)

    def _pump(self, conn: _Conn, now: float) -> None:
        """Move due chunks through the watcher into the output buffers; cut or close when it is time."""
        for half in (conn.up, conn.down):
            while half.delayed and half.delayed[0][0] <= now and not conn.closed:
                cut = self._through(conn, half, half.delayed.popleft()[1])
                if cut is not None:
                    self._fault_cut(conn, cut)
                    return
            if half.out:
                try:
                    del half.out[:half.dst.send(half.out)]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    self._close(conn, f"reset ({e})", reset=True)
                    return
            if half.eof and not half.delayed and not half.out:
                self._close(conn, "closed by the " + ("client" if half is conn.up else "server"), reset=False)
                return

    def _through(self, conn: _Conn, half: _Half, chunk: bytes) -> str | None:
        """Pass ``chunk`` through the watcher into ``half``'s output; why to cut the connection, or None."""
        if conn.watcher is None:
            half.out += chunk
            return None
        if half is conn.up:
            cut = conn.watcher.client(chunk)
            if cut is None:
                half.out += chunk
            return cut
        forward, cut = conn.watcher.server(chunk)
        half.out += forward
        return cut

    def _fault_cut(self, conn: _Conn, why: str) -> None:
        self.cuts += 1
        if why.startswith("cut after COMMIT"):
            self.commits_cut += 1
            if conn.watcher is not None:
                self.cut_transactions.append(conn.watcher.cut_transaction)
        elif why.startswith("cut before COMMIT"):
            self.commits_refused += 1
            if conn.watcher is not None:
                self.refused_transactions.append(conn.watcher.cut_transaction)
        else:
            self.transactions_cut += 1
        self._close(conn, why, reset=True)

    def _close(self, conn: _Conn, why: str, reset: bool) -> None:
        conn.closed = True
        self._conns.pop(conn.cid, None)
        if conn.watcher is not None and conn.watcher.unfired:
            # The client gave up (a deadline, say) before the answer its armed fault waited for: no
            # answer was cut, so the fault is still owed to the next COMMIT or statement.
            for kind in conn.watcher.unfired:
                self._armed[kind] += 1
            self._log(f"conn#{conn.cid} gives back unfired fault(s) {conn.watcher.unfired}")
            conn.watcher.unfired.clear()
        for sock in (conn.up.src, conn.down.src):
            if self._masks.pop(sock, None) is not None:
                self._sel.unregister(sock)
            with contextlib.suppress(OSError):
                if reset:  # linger 0: close() sends RST instead of FIN, and drops unsent data
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
        self._log(f"conn#{conn.cid} {why}")
