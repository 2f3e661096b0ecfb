"""One frozen settings object, built from arguments and ``KSTORE_*`` variables.

Defaults live here and nowhere else. Nothing reads the environment at import
time: :meth:`Settings.from_env` does, when called.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from kstore.errors import ConfigurationError
from kstore.kafka.options import check_kafka_options, check_security, shown_options

ENV_PREFIX = "KSTORE_"
#: ``KSTORE_KAFKA_<NAME>`` sets the Kafka client's option ``<name>`` (see ``kafka_options``).
KAFKA_ENV_PREFIX = "KSTORE_KAFKA_"
#: Settings whose variable starts like a Kafka option's: ``KSTORE_KAFKA_CLIENT`` is the setting.
_KAFKA_SETTINGS = ("KSTORE_KAFKA_CLIENT",)
#: Settings that hold a secret: never in repr, logs or errors; each can be read from a
#: file (``KSTORE_<NAME>_FILE``, or ``<name>_file=`` given to from_env), the container convention.
SECRETS = ("dsn", "sasl_password", "ssl_key_password", "schema_registry_password", "console_password",
           "console_session_key")
# Variables under the prefix that belong to tools around kstore, not to Settings.
_FOREIGN_ENV = ("KSTORE_TEST_", "KSTORE_SIM_", "KSTORE_CACHE_DIR", "KSTORE_DEBUG", "KSTORE_LOG_FORMAT")
START_POLICIES = ("earliest", "latest")


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs to know. Each field is also a ``KSTORE_<FIELD>`` variable; the
    documentation's configuration page lists them all, with their flags."""

    #: The database: a SQLAlchemy URL, ``postgresql+psycopg2://user:pass@host/db`` (or
    #: ``postgresql+psycopg://`` for psycopg 3, ``postgres://`` is read as ``postgresql://``;
    #: libpq parameters such as ``sslmode`` go in its query string) or ``sqlite:///file.db``.
    dsn: str = field(default="sqlite:///kstore.db", repr=False)
    #: Kafka brokers, ``host:port[,host:port...]``; one that answers is enough to start.
    bootstrap_servers: str = "127.0.0.1:9092"
    #: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    security_protocol: str = "PLAINTEXT"
    #: With SASL_*: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER (or AWS_MSK_IAM, GSSAPI).
    sasl_mechanism: str | None = None
    #: PLAIN and SCRAM: the user name (Confluent Cloud: the API key).
    sasl_username: str | None = None
    #: PLAIN and SCRAM: the password; better from a file (``KSTORE_SASL_PASSWORD_FILE``).
    sasl_password: str | None = field(default=None, repr=False)
    #: OAUTHBEARER: ``MODULE:CALLABLE``, a function returning the current token, or a
    #: kafka-python ``AbstractTokenProvider`` subclass (made without arguments) or instance.
    sasl_oauth_token_provider: str | None = None
    #: The CA certificate(s) that signed the brokers' certificates, PEM; default: the system's.
    ssl_cafile: str | None = None
    #: Mutual TLS: the client certificate (PEM; may hold the key too) and its key.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: The client key's password, if it is encrypted (``KSTORE_SSL_KEY_PASSWORD_FILE``).
    ssl_key_password: str | None = field(default=None, repr=False)
    #: Check that a broker's certificate is for the host connected to. Leave it on.
    ssl_check_hostname: bool = True
    #: The schema registry (Confluent's API: Confluent Schema Registry, Apicurio's ``/apis/ccompat/v7``,
    #: Karapace), ``http(s)://host:port[/path]``; comma-separated for several. Needed by the formats
    #: ``avro``, ``protobuf`` and ``json-schema`` and by ``produce()`` with a schema.
    schema_registry_url: str | None = None
    #: HTTP basic authentication with the registry (Confluent Cloud: the API key and its secret).
    schema_registry_username: str | None = None
    #: Its password; better from a file (``KSTORE_SCHEMA_REGISTRY_PASSWORD_FILE``).
    schema_registry_password: str | None = field(default=None, repr=False)
    #: The CA certificate(s) of the registry's TLS certificate, PEM; default: the system's.
    schema_registry_cafile: str | None = None
    #: Mutual TLS with the registry: the client certificate and its key (PEM).
    schema_registry_certfile: str | None = None
    schema_registry_keyfile: str | None = None
    #: How long one request to the registry may take before it counts as an outage.
    schema_registry_timeout_s: float = 10.0
    #: Any other consumer option of the Kafka client by name: librdkafka's, e.g.
    #: ``{"fetch.max.bytes": 1048576}``, or with ``kafka_client="kafka-python"`` kafka-python's, e.g.
    #: ``{"fetch_max_bytes": 1048576}``; names are checked (and kafka-python's text values converted
    #: to the option's type) when Settings is made.
    #: ``isolation.level`` is ``read_committed`` unless set here: records of aborted upstream
    #: transactions are never delivered (``read_uncommitted`` delivers them too).
    kafka_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: The Kafka client: ``confluent`` (confluent-kafka, on librdkafka; ``kafka_options`` are
    #: librdkafka's properties, ``fetch.max.bytes``) or ``kafka-python`` (pure Python, ``pip install
    #: 'kstore[kafka-python]'``; ``kafka_options`` are its names, ``fetch_max_bytes``). Same
    #: guarantees with either; librdkafka is faster and alone offers the cooperative protocols.
    kafka_client: str = "confluent"
    #: How the worker's Kafka group rebalances: ``eager`` (every rebalance revokes every partition
    #: of every worker, which claims them again), ``cooperative`` (the classic protocol with
    #: librdkafka's cooperative-sticky assignor: only partitions that move are revoked) or
    #: ``consumer`` (Kafka's next-generation group protocol, KIP-848: the broker assigns,
    #: incrementally; its session timeout is the broker's ``group.consumer.session.timeout.ms``, see
    #: the docs). ``cooperative`` and ``consumer`` need ``kafka_client="confluent"``. Unset: ``cooperative``
    #: on confluent, ``eager`` on kafka-python. One group runs one protocol: change it by stopping
    #: every worker.
    rebalance_protocol: str = ""
    #: Overrides the processor's ``group`` when set.
    group: str | None = None
    #: Overrides the processor's ``topics`` when not empty.
    topics: tuple[str, ...] = ()
    #: Where a partition with no stored offset starts: earliest, latest or an ISO 8601 time.
    start_from: str = "earliest"
    #: Overrides the processor's ``on_error``: "stop" or "dead_letter".
    on_error: str | None = None
    #: Overrides the processor's ``dead_letter_topic``: the Kafka topic each dead letter is also produced
    #: to, exactly once, in the transaction that writes it (``""``: none, whatever the processor says).
    dead_letter_topic: str | None = None
    #: Async processors (``async def handle``): overrides the processor's ``max_concurrency``, the
    #: most messages of a batch handled at once.
    max_concurrency: int | None = None
    #: Async processors: overrides the processor's ``ordering`` ("key", "partition" or "none"):
    #: which messages of a batch run one after another, in offset order.
    ordering: str | None = None
    #: Overrides the processor's ``retry.max_attempts``.
    max_attempts: int | None = None
    #: With on_error=dead_letter: this many messages in a row dead-lettered after failing every
    #: attempt (a crash: an error the processor did not mean), with no message handled in between,
    #: trip the breaker (see ``dead_letter_breaker``): a processor that fails on every message is
    #: more likely broken than every message bad. 0: never.
    max_consecutive_dead_letters: int = 20
    #: The same for messages rejected on purpose (``Reject``, an error in ``retry.give_up_on``, a
    #: message that cannot be deserialized): cheap, and each the processor's judgement of the
    #: message, so far more of them in a row are allowed before it looks like a systematic fault
    #: (an upstream schema change, a validation bug). 0: never.
    max_consecutive_rejects: int = 1000
    #: What a tripped breaker does: "stop" the worker (exit 1, one line naming the last message),
    #: or "pause" it (no more batches, /readyz unready with the reason, until it is restarted).
    dead_letter_breaker: str = "stop"
    #: Raise on an invalid reset target instead of falling back to ``start_from``.
    strict_resets: bool = False
    #: Most messages per transaction. Each transaction costs a few round trips (the
    #: offsets UPDATE, COMMIT), so larger batches amortise them: 5000 drains a backlog
    #: about 15% faster than 1000 (docs/benchmarks.md). A steady stream still commits
    #: small batches (see batch_linger_ms), and a failing batch is retried in halves.
    max_batch_size: int = 5000
    #: How long a batch may wait for more messages when fewer than max_batch_size are
    #: queued, while the worker drains a backlog (its last batch was at least half of
    #: max_batch_size): transactions stay large instead of taking whatever the fetcher has
    #: decoded so far. A steady stream below that pace is never delayed by it.
    batch_linger_ms: int = 5
    #: Most records one poll() returns; what is not yet in a batch waits in kstore's queues.
    max_poll_records: int = 1000
    #: How long one poll() waits for records; also bounds how soon the fetch thread sees a stop.
    poll_timeout_ms: int = 200
    #: Fetching pauses while records waiting in kstore's queues take this much memory.
    max_buffered_bytes: int = 32 * 2**20
    #: Kafka group session: a worker that stops heartbeating (killed, paused) loses its
    #: partitions after this long, and its late commits are fenced.
    session_timeout_ms: int = 6_000
    #: How often the worker heartbeats to the group (about a third of the session timeout).
    heartbeat_interval_ms: int = 2_000
    #: Kafka's limit between two polls. kstore polls from its own thread whatever a batch
    #: does, so a slow handler does not hit it.
    max_poll_interval_ms: int = 300_000
    #: PostgreSQL: how long a claim waits for a row lock held by a paused zombie.
    claim_lock_timeout_ms: int = 5_000
    #: PostgreSQL: a paused zombie's open transaction is ended after this long, so its row locks
    #: hold up the new owner's claim no longer. Longer than the session timeout by default, so a
    #: handler that waits a few seconds between two statements is not cut off.
    idle_in_transaction_timeout_ms: int = 10_000
    #: PostgreSQL: a round trip on kstore's connections (a statement, COMMIT) that gets no
    #: answer within this many seconds is abandoned: the connection is cut and what was
    #: in flight is resolved (a COMMIT is read back). Also the TCP user timeout. It caps
    #: how long one statement of a processor may run; 0 turns the deadline off.
    db_timeout_s: float = 30.0
    #: Show the values bound to a statement the database refused in log lines and the worker's
    #: errors (SQLAlchemy's ``[parameters: ...]``, the server's ``DETAIL``): a message's contents,
    #: often personal data, so only to debug. Off, a failure is logged by its type and first line;
    #: the dead letter keeps it whole either way.
    log_statement_parameters: bool = False
    #: Seconds to wait at start-up for brokers that do not answer. An address where no broker can
    #: be (its port refuses connections, its name does not resolve) is reported sooner, after three
    #: tries in 2 s.
    connect_timeout_s: float = 30.0
    #: After SIGTERM/SIGINT, how long the batch in flight may run before it is rolled back.
    shutdown_timeout_s: float = 30.0
    #: How often a worker checks its partitions' epochs, to pick up an operator's reset.
    epoch_check_interval_s: float = 1.0
    #: After each commit, also commit the offsets to Kafka (asynchronously, metadata
    #: ``kstore-mirror``) so Kafka's own lag tools see the pipeline. kstore never reads them.
    mirror_offsets: bool = False
    #: Run the outbox relay inside the worker (publishes what ``Processor.produce`` wrote). Turn it
    #: off only where ``kstore relay`` runs apart.
    relay: bool = True
    #: Outbox shards of a group, fixed when its first worker or relay starts (an application outbox's
    #: come from its ``Outbox(name, shards=...)``, this when none is given): one key's records
    #: are in one shard, published in commit order by one relay at a time. More shards let relays
    #: in several processes publish side by side; in one process they share its one interpreter
    #: (kafka-python's transactions are CPU-bound), and one shard has the lowest latency.
    outbox_shards: int = 1
    #: The Kafka client the relay publishes with: ``"confluent"`` (librdkafka, which encodes and
    #: sends in C on threads of its own) or ``"kafka-python"``. Unset: ``kafka_client``.
    relay_client: str = ""
    #: A relay that stops renewing its shards' leases (killed, paused) loses them after this long.
    outbox_lease_s: float = 10.0
    #: How often a relay looks for rows when nothing woke it (on PostgreSQL the first commit after
    #: it went idle wakes it with LISTEN/NOTIFY, and a worker's own relay at each of its commits).
    outbox_poll_interval_s: float = 1.0
    #: A produced record (key, value and headers) larger than this is refused at ``produce()``:
    #: keep it at or below the topics' ``max.message.bytes``.
    outbox_max_record_bytes: int = 1_000_000
    #: How long a topic's partition count, as read for ``produce()``, is trusted: a topic found
    #: missing is looked up again after this long (a batch producing to it waits meanwhile, as in
    #: an outage), and one found is looked up again too, so that its deletion is noticed.
    topic_recheck_s: float = 10.0
    #: The worker stops taking batches while more produced records than this wait to be
    #: published (a broker outage): the outbox grows no further, and /readyz says why.
    outbox_max_pending: int = 100_000
    #: Serve /metrics, /livez and /readyz on this port (off when unset; 0 picks a free port).
    metrics_port: int | None = None
    #: The address the metrics port listens on: ``0.0.0.0``, every interface, which Kubernetes probes
    #: and a Prometheus in another pod need; ``127.0.0.1`` for this host only; or one interface's address.
    metrics_host: str = "0.0.0.0"
    #: /livez turns unhealthy once the batch loop or the fetch thread has not turned for this
    #: long (a handler that never returns). Longer than your slowest batch.
    liveness_timeout_s: float = 300.0
    #: Kafka client id; default: the worker's own name, ``kstore-<host>-<pid>-<random>``, as in its
    #: log lines and the database, so `kstore offsets show` and `kstore top` name the owner the same.
    #: Set, it replaces that name in their OWNER column (give each worker its own).
    client_id: str | None = None
    #: ``kstore console``: the password an operator logs in with (every page and action but in
    #: ``console_read_only``); better from a file (``KSTORE_CONSOLE_PASSWORD_FILE``). Compared by its hash.
    console_password: str | None = field(default=None, repr=False)
    #: ``kstore console`` behind a proxy that authenticates: the request header holding the operator's
    #: name (e.g. ``X-Forwarded-User``). Only where no one can reach the console but through that proxy.
    console_user_header: str | None = None
    #: ``kstore console``: the key that signs its login form's token and ties logins to the password
    #: (default: a new random one each start, which logs everyone out at a restart); give one to keep
    #: logins across restarts, the same one to several consoles behind one address.
    console_session_key: str | None = field(default=None, repr=False)
    #: ``kstore console`` behind proxies: the addresses (IPs, or networks such as ``10.0.0.0/8``) of those
    #: whose ``X-Forwarded-For`` is believed for the client's address (so the login throttle counts each
    #: client apart) and ``X-Forwarded-Proto`` for the scheme. Empty: no ``X-Forwarded-*`` header is
    #: believed, from anyone.
    console_trusted_proxies: tuple[str, ...] = ()
    #: ``kstore console``: mark its cookies ``Secure`` even on a request that came in over plain HTTP: behind a
    #: proxy that ends TLS but is not among ``console_trusted_proxies`` (one that is says ``https`` itself).
    console_secure_cookie: bool = False
    #: ``kstore console``: show, never act; no login is asked for.
    console_read_only: bool = False
    #: ``kstore console``: seconds between two samples of every group's lag (its charts); 0: no sampling.
    console_sample_interval_s: float = 15.0
    #: ``kstore console``: how long lag samples are kept (older ones are deleted as new ones are written).
    console_sample_retention_s: float = 6 * 3600.0
    #: PostgreSQL: the schema of kstore's tables (default: the search path's).
    schema: str | None = None
    #: The prefix of kstore's tables (``kstore_offsets``, ...), e.g. to run two kstore
    #: installations in one database.
    table_prefix: str = "kstore_"

    def __post_init__(self) -> None:
        if isinstance(self.topics, str):
            object.__setattr__(self, "topics", _split(self.topics))
        proxies = self.console_trusted_proxies
        object.__setattr__(self, "console_trusted_proxies", _split(proxies) if isinstance(proxies, str)
                           else tuple(p.strip() for p in proxies))
        _check_proxies(self.console_trusted_proxies)
        object.__setattr__(self, "security_protocol", self.security_protocol.strip().upper())
        if self.sasl_mechanism is not None:
            object.__setattr__(self, "sasl_mechanism", self.sasl_mechanism.strip().upper())
        # Checked and converted once (names normalised, text to the option's type); the clients use it as it is.
        object.__setattr__(self, "kafka_client", self.kafka_client.strip().lower())
        object.__setattr__(self, "kafka_options", check_kafka_options(self.kafka_options, self.kafka_client))
        protocol = self.rebalance_protocol.strip().lower() or default_rebalance_protocol(self.kafka_client)
        object.__setattr__(self, "rebalance_protocol", protocol)
        _check_rebalance_protocol(self.rebalance_protocol, self.kafka_client)
        object.__setattr__(self, "relay_client", self.relay_client.strip().lower() or self.kafka_client)
        if self.dsn.startswith(("postgres://", "postgres+")):  # libpq's and Heroku's spelling
            object.__setattr__(self, "dsn", "postgresql" + self.dsn[len("postgres"):])
        check_security(self)
        for name in ("max_batch_size", "max_poll_records", "poll_timeout_ms", "session_timeout_ms", "topic_recheck_s",
                     "schema_registry_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
        parse_start_policy(self.start_from)
        if self.on_error not in (None, "stop", "dead_letter"):
            raise ConfigurationError(f"on_error must be stop or dead_letter, got {self.on_error!r}")
        _check_choices(self.max_concurrency, self.ordering, self.relay_client)
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        _check_breaker(self.max_consecutive_dead_letters, self.max_consecutive_rejects, self.dead_letter_breaker)
        try:
            make_url(self.dsn)
        except (ArgumentError, ValueError):  # ValueError: a port that is not a number
            raise ConfigurationError(
                "malformed DSN: expected a SQLAlchemy URL, e.g. sqlite:///kstore.db or "
                "postgresql+psycopg2://user@host/db (user:password@host with a password)"
            ) from None
        if not self.table_prefix.replace("_", "").isalnum():
            raise ConfigurationError(f"table_prefix must be letters, digits and _: {self.table_prefix!r}")

    @property
    def safe_dsn(self) -> str:
        """The DSN with its password masked, for logs and messages."""
        return make_url(self.dsn).render_as_string(hide_password=True)

    def __repr__(self) -> str:
        # The dataclass's own repr, but for secrets: left out, or (a Kafka option's) shown as ***.
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        values["kafka_options"] = shown_options(self.kafka_options)
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in values.items())})"

    @property
    def secrets(self) -> list[str]:
        """Every secret value these settings hold (the DSN's password too): what a
        :class:`~kstore.ops.masking.Masker` needs to find where one ends in a driver's text."""
        found = [make_url(self.dsn).password, self.sasl_password, self.ssl_key_password, self.schema_registry_password,
                 self.console_password, self.console_session_key, *_url_passwords(self.schema_registry_url)]
        return [str(v) for v in found if v]

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed; ``None`` values are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``KSTORE_<FIELD>`` variables, then ``overrides`` (``None`` = unset).

        An unknown ``KSTORE_*`` variable is an error, so a typo is not silently ignored.
        ``KSTORE_KAFKA_<NAME>`` sets an option of ``kafka_client`` (a librdkafka property on
        ``confluent``, its underscores read as dots; a kafka-python option on ``kafka-python``),
        added to ``kafka_options``; ``KSTORE_<SECRET>_FILE`` (and an
        override ``<secret>_file``) reads a secret from a file. ``kafka_options`` given as an
        override add to (and win over) those from the environment.
        """
        types = {f.name: f.type for f in fields(cls)}
        values, kafka_options = _read_environ(os.environ if environ is None else environ, types)
        for secret in SECRETS:
            path = overrides.pop(f"{secret}_file", None)
            if path is not None:
                if overrides.get(secret) is not None:
                    raise ConfigurationError(f"give {secret} or {secret}_file, not both")
                overrides[secret] = _read_secret(f"--{secret.replace('_', '-')}-file", path)
        kafka_options.update(overrides.pop("kafka_options", None) or {})
        values.update({k: v for k, v in overrides.items() if v is not None})
        if kafka_options:
            values["kafka_options"] = kafka_options
        unknown = set(values) - set(types)
        if unknown:
            raise ConfigurationError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return cls(**values)


def _url_passwords(urls: str | None) -> list[str]:
    """The passwords written into a comma-separated list of URLs (``https://user:password@host``)."""
    from urllib.parse import urlsplit

    return [p for p in (urlsplit(u.strip()).password for u in (urls or "").split(",")) if p]


def _check_breaker(max_dead_letters: int, max_rejects: int, breaker: str) -> None:
    for name, value in (("max_consecutive_dead_letters", max_dead_letters), ("max_consecutive_rejects", max_rejects)):
        if value < 0:
            raise ConfigurationError(f"{name} must be 0 (never) or more, got {value}")
    if breaker not in ("stop", "pause"):
        raise ConfigurationError(f"dead_letter_breaker must be stop or pause, got {breaker!r}")


def _check_proxies(proxies: tuple[str, ...]) -> None:
    """Each is an address or a network: uvicorn would take anything else as a name that no client
    address ever equals, and the proxy's headers would be silently ignored."""
    for proxy in proxies:
        try:
            if "/" in proxy:
                ipaddress.ip_network(proxy)
            else:
                ipaddress.ip_address(proxy)
        except ValueError as exc:
            reason = f" ({exc})" if "/" in proxy else ""
            raise ConfigurationError(f"console_trusted_proxies: {proxy!r} is not an IP address or network, "
                                     f"e.g. 10.0.0.5 or 10.0.0.0/8{reason}") from None


REBALANCE_PROTOCOLS = ("eager", "cooperative", "consumer")


def default_rebalance_protocol(client: str) -> str:
    """Cooperative where the client offers it (librdkafka): a rebalance then moves only the
    partitions that change hands, and a rolling restart pauses the others for nothing."""
    return "cooperative" if client == "confluent" else "eager"


def _check_rebalance_protocol(protocol: str, client: str) -> None:
    if protocol not in REBALANCE_PROTOCOLS:
        raise ConfigurationError(f"rebalance_protocol must be {', '.join(REBALANCE_PROTOCOLS[:-1])} or "
                                 f"{REBALANCE_PROTOCOLS[-1]}, got {protocol!r}")
    if protocol != "eager" and client != "confluent":
        raise ConfigurationError(f"rebalance_protocol {protocol} needs kafka_client confluent (kstore's kafka-python "
                                 "backend rebalances eagerly only)")


def _check_choices(max_concurrency: int | None, ordering: str | None, relay_client: str) -> None:
    if max_concurrency is not None and max_concurrency < 1:
        raise ConfigurationError(f"max_concurrency must be at least 1, got {max_concurrency}")
    if ordering not in (None, "key", "partition", "none"):
        raise ConfigurationError(f"ordering must be key, partition or none, got {ordering!r}")
    if relay_client not in ("confluent", "kafka-python"):
        raise ConfigurationError(f"relay_client must be kafka-python or confluent, got {relay_client!r}")


def _read_environ(env: Mapping[str, str], types: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Settings and Kafka options from ``KSTORE_*`` variables."""
    values: dict[str, Any] = {}
    kafka_options: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(_FOREIGN_ENV):
            continue
        if key.startswith(KAFKA_ENV_PREFIX) and key not in _KAFKA_SETTINGS:
            kafka_options[key[len(KAFKA_ENV_PREFIX):].lower()] = raw
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name.endswith("_file") and name[:-5] in SECRETS:
            _set_once(values, name[:-5], _read_secret(key, raw), key)
            continue
        if name not in types:
            raise ConfigurationError(f"unknown setting in environment: {key}")
        _set_once(values, name, _convert(key, raw, str(types[name])), key)
    return values, kafka_options


def _set_once(values: dict[str, Any], name: str, value: Any, key: str) -> None:
    if name in values:
        raise ConfigurationError(f"{key}: {name} is given twice (as KSTORE_{name.upper()} and "
                                 f"KSTORE_{name.upper()}_FILE); keep one")
    values[name] = value


def _read_secret(source: str, path: str) -> str:
    """A secret file's content without its trailing line break (as `echo` or an editor leaves it)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except OSError as exc:
        raise ConfigurationError(f"cannot read the secret file {source}={path}: {exc.strerror}") from None


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
