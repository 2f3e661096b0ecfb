"""What a relay holds, shared by its parts: its outbox, its settings, the lanes it holds, its Kafka
reader, its events and locks. :class:`RelayBase` is made once per relay; the lease loop
(:mod:`kstore.relay.loop`), the lanes' publishing (:mod:`kstore.relay.publishing`) and the
departures (:mod:`kstore.relay.departures`) are the methods on it.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from kstore.db.sqlerrors import first_line
from kstore.errors import DatabaseError
from kstore.kafka.clients import admin_reader, publisher_class
from kstore.kafka.seam import AdminReader
from kstore.settings import Settings
from kstore.telemetry.metrics import Metrics

from .lane import RETRY_DELAY_S, Lane
from .listener import Listener
from .member import member_name
from .publisher import PublisherFactory
from .store import Outbox
from .tables import Backlog


class RelayBase:
    """A relay's state (see :class:`kstore.relay.loop.Relay`, which is what callers make)."""

    def __init__(self, settings: Settings, group: str, engine: Engine, metrics: Metrics | None = None,
                 member: str | None = None, wait_for_outbox: bool = False) -> None:
        self.settings = settings
        self.group = group
        self.wait_for_outbox = wait_for_outbox
        #: Why it does not publish yet, while it waits for the application to set the outbox up.
        self._waiting_for: str | None = None
        self.outbox = Outbox(engine, group, settings.table_prefix, settings.schema)
        self.member = member or member_name()
        self.metrics = metrics or Metrics(group)
        # Read at a scrape (kept a few seconds), not by the publishing loop: no statement while nobody
        # looks, and a scrape's answer is never older than that.
        self.metrics.watch_outbox(self._backlog)
        #: The lanes this relay holds, by number.
        self._held: dict[int, Lane] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publisher_class: PublisherFactory = publisher_class(settings.relay_client)
        #: The shards' progress and the group's members, asked on the relay's client (made when first needed).
        self._admin: AdminReader | None = None
        self._admin_lock = threading.Lock()
        self._progress_topic_ready = False
        self._listener: Listener | None = None
        self._next_heartbeat = 0.0
        self._delay, self._not_before = RETRY_DELAY_S, 0.0
        #: The last error of the lease thread, and of any shard (each said once per distinct reason).
        self.last_error: str | None = None
        self._shard_reason: str | None = None
        #: What ended the relay's thread, if anything did (a bug): the worker stops on it.
        self.error: BaseException | None = None
        #: When the lease loop last turned, and whether it has read the shards (for the probes).
        self._turned_at = time.monotonic()
        self._running = False
        #: Time the process was seen not running (SIGSTOP, a frozen VM): the lease loop turned
        #: that much later than it can. Not counted against a Kafka transaction (see _check_stuck).
        self._paused_s = 0.0
        #: The group's members when last described settled; a relay among them that is gone the
        #: next time has lost its worker (see group_changed). Only the departures thread uses it.
        self._in_group: set[str] = set()
        self._departures_lock = threading.Lock()
        self._departures_due = self._departures_running = False
        #: Set when shards were freed: the lease loop takes them now, not at its next heartbeat.
        self._heartbeat_now = threading.Event()

    def _backlog(self) -> Backlog:
        """The outbox's backlog, for its gauges; a database error as its first line (no SQL in a log)."""
        try:
            return self.outbox.waiting()
        except SQLAlchemyError as exc:
            raise DatabaseError(first_line(exc)) from None

    def _reader(self) -> AdminReader:
        """The relay's :class:`GroupReader` (callers hold ``_admin_lock``). It does not ask again after a
        "not now": the shard backs off and tries again (and the group is described again) by itself."""
        if self._admin is None:
            self._admin = admin_reader(self.settings, relay=True, patience_s=0)
        return self._admin
