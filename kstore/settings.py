"""One frozen settings object, built from arguments and ``KSTORE_*`` variables.

Defaults live here and nowhere else. Nothing reads the environment at import
time: :meth:`Settings.from_env` does, when called.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .errors import ConfigurationError

ENV_PREFIX = "KSTORE_"
# Variables under the prefix that belong to tools around kstore, not to Settings.
_FOREIGN_ENV = ("KSTORE_TEST_", "KSTORE_CACHE_DIR", "KSTORE_DEBUG")
START_POLICIES = ("earliest", "latest")


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs to know; see the README for each field."""

    dsn: str = "sqlite:///kstore.db"
    bootstrap_servers: str = "127.0.0.1:9092"
    #: Overrides the processor's ``group`` when set.
    group: str | None = None
    #: Overrides the processor's ``topics`` when not empty.
    topics: tuple[str, ...] = ()
    #: Where a partition with no stored offset starts: earliest, latest or an ISO 8601 time.
    start_from: str = "earliest"
    #: Overrides the processor's ``on_error``: "stop" or "dead_letter".
    on_error: str | None = None
    #: Overrides the processor's ``retry.max_attempts``.
    max_attempts: int | None = None
    #: Raise on an invalid reset target instead of falling back to ``start_from``.
    strict_resets: bool = False
    #: Most messages per transaction. Each transaction costs a few round trips (the
    #: offsets UPDATE, COMMIT), so larger batches amortise them: 5000 drains a backlog
    #: about 15% faster than 1000 (docs/benchmarks.md). A steady stream still commits
    #: small batches (see batch_linger_ms), and a failing batch is retried in halves.
    max_batch_size: int = 5000
    #: How long a batch may wait for more messages when fewer than max_batch_size are
    #: queued: a steady stream then commits a few larger batches instead of many tiny
    #: ones (each commit costs round trips and an fsync), for at most this much latency.
    batch_linger_ms: int = 5
    #: Most records one poll() returns; what is not yet in a batch waits in kstore's queues.
    max_poll_records: int = 1000
    poll_timeout_ms: int = 200
    #: Fetching pauses while records waiting in kstore's queues take this much memory.
    max_buffered_bytes: int = 32 * 2**20
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    #: PostgreSQL: how long a claim waits for a row lock held by a paused zombie.
    claim_lock_timeout_ms: int = 5_000
    #: PostgreSQL: a paused zombie's open transaction is ended after this long,
    #: so it cannot hold the offsets' row locks past the Kafka session timeout.
    idle_in_transaction_timeout_ms: int = 10_000
    #: PostgreSQL: a round trip on kstore's connections (a statement, COMMIT) that gets no
    #: answer within this many seconds is abandoned: the connection is cut and what was
    #: in flight is resolved (a COMMIT is read back). Also the TCP user timeout. It caps
    #: how long one statement of a processor may run; 0 turns the deadline off.
    db_timeout_s: float = 30.0
    #: Seconds to wait for the brokers at start-up.
    connect_timeout_s: float = 30.0
    #: After SIGTERM/SIGINT, how long the batch in flight may run before it is rolled back.
    shutdown_timeout_s: float = 30.0
    #: How often a worker checks its partitions' epochs, to pick up an operator's reset.
    epoch_check_interval_s: float = 1.0
    #: Kafka client id; default ``kstore-<host>-<pid>`` so `kstore offsets show` can name the owner.
    client_id: str | None = None
    schema: str | None = None
    table_prefix: str = "kstore_"

    def __post_init__(self) -> None:
        if isinstance(self.topics, str):
            object.__setattr__(self, "topics", _split(self.topics))
        for name in ("max_batch_size", "max_poll_records", "poll_timeout_ms", "session_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
        parse_start_policy(self.start_from)
        if self.on_error not in (None, "stop", "dead_letter"):
            raise ConfigurationError(f"on_error must be stop or dead_letter, got {self.on_error!r}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        try:
            make_url(self.dsn)
        except ArgumentError:
            raise ConfigurationError(
                "malformed DSN: expected e.g. postgresql+psycopg2://user:pass@host/db "
                "or sqlite:///kstore.db"
            ) from None
        if not self.table_prefix.replace("_", "").isalnum():
            raise ConfigurationError(f"table_prefix must be letters, digits and _: {self.table_prefix!r}")

    @property
    def safe_dsn(self) -> str:
        """The DSN with its password masked, for logs and messages."""
        return make_url(self.dsn).render_as_string(hide_password=True)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed; ``None`` values are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``KSTORE_<FIELD>`` variables, then ``overrides`` (``None`` = unset).

        An unknown ``KSTORE_*`` variable is an error, so a typo is not silently ignored.
        """
        env = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX) or key.startswith(_FOREIGN_ENV):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name not in types:
                raise ConfigurationError(f"unknown setting in environment: {key}")
            values[name] = _convert(key, raw, str(types[name]))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(types)
        if unknown:
            raise ConfigurationError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return cls(**values)


def _split(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _convert(key: str, raw: str, type_name: str) -> Any:
    try:
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
        if type_name.startswith("bool"):
            return _parse_bool(raw)
    except ValueError:
        raise ConfigurationError(f"{key}={raw!r} is not a valid {type_name.split()[0]}") from None
    if type_name.startswith("tuple"):
        return _split(raw)
    return raw


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def parse_start_policy(raw: str) -> str | datetime:
    """``earliest``/``latest`` or a timezone-aware datetime from an ISO 8601 string."""
    if raw in START_POLICIES:
        return raw
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise ConfigurationError(
            f"start_from must be earliest, latest or an ISO 8601 time, got {raw!r}"
        ) from None
    if when.tzinfo is None:
        raise ConfigurationError(f"start_from time needs a timezone, e.g. {raw}+00:00")
    return when
