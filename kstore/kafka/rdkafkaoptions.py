"""Which librdkafka options the confluent-kafka backend accepts by name: pure checks.

With ``kafka_client="confluent"`` the worker's consumer is librdkafka's, and ``kafka_options``
are librdkafka's configuration properties (``fetch.max.bytes``, ``socket.keepalive.enable``...).
:func:`check_librdkafka_options` checks their names (a typo is one clear line before anything
connects) and turns values into the text librdkafka parses; librdkafka itself checks the values
when the consumer is made. Nothing here imports confluent-kafka: :data:`LIBRDKAFKA_OPTIONS` is
librdkafka's own list of consumer and general properties (its CONFIGURATION.md), written out; a
test holds every name to the installed librdkafka (tests/unit/kafka/test_kafka_settings.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kstore.errors import ConfigurationError

#: librdkafka's general and consumer properties that take a text value (the C pointers and
#: callbacks, which cannot be given as text, are left out).
_NAMES = """
builtin.features client.id metadata.broker.list bootstrap.servers message.max.bytes message.copy.max.bytes
receive.message.max.bytes max.in.flight.requests.per.connection max.in.flight metadata.recovery.strategy
metadata.recovery.rebootstrap.trigger.ms topic.metadata.refresh.interval.ms metadata.max.age.ms
topic.metadata.refresh.fast.interval.ms topic.metadata.refresh.fast.cnt topic.metadata.refresh.sparse
topic.metadata.propagation.max.ms topic.blacklist debug socket.timeout.ms socket.blocking.max.ms
socket.send.buffer.bytes socket.receive.buffer.bytes socket.keepalive.enable socket.nagle.disable socket.max.fails
broker.address.ttl broker.address.family socket.connection.setup.timeout.ms connections.max.idle.ms
reconnect.backoff.jitter.ms reconnect.backoff.ms reconnect.backoff.max.ms statistics.interval.ms log_level
log.thread.name enable.random.seed log.connection.close internal.termination.signal api.version.request
api.version.request.timeout.ms api.version.fallback.ms broker.version.fallback allow.auto.create.topics
security.protocol ssl.cipher.suites ssl.curves.list ssl.sigalgs.list ssl.key.location ssl.key.password ssl.key.pem
ssl.certificate.location ssl.certificate.pem ssl.ca.location https.ca.location https.ca.pem ssl.ca.pem
ssl.ca.certificate.stores ssl.crl.location ssl.keystore.location ssl.keystore.password ssl.providers
ssl.engine.location ssl.engine.id enable.ssl.certificate.verification ssl.endpoint.identification.algorithm
sasl.mechanisms sasl.mechanism sasl.kerberos.service.name sasl.kerberos.principal sasl.kerberos.kinit.cmd
sasl.kerberos.keytab sasl.kerberos.min.time.before.relogin sasl.username sasl.password sasl.oauthbearer.config
enable.sasl.oauthbearer.unsecure.jwt sasl.oauthbearer.method sasl.oauthbearer.client.id
sasl.oauthbearer.client.credentials.client.id sasl.oauthbearer.client.credentials.client.secret
sasl.oauthbearer.client.secret sasl.oauthbearer.scope sasl.oauthbearer.extensions
sasl.oauthbearer.token.endpoint.url sasl.oauthbearer.sub.claim.name sasl.oauthbearer.grant.type
sasl.oauthbearer.assertion.algorithm sasl.oauthbearer.assertion.private.key.file
sasl.oauthbearer.assertion.private.key.passphrase sasl.oauthbearer.assertion.private.key.pem
sasl.oauthbearer.assertion.file sasl.oauthbearer.assertion.claim.aud sasl.oauthbearer.assertion.claim.exp.seconds
sasl.oauthbearer.assertion.claim.iss sasl.oauthbearer.assertion.claim.jti.include
sasl.oauthbearer.assertion.claim.nbf.seconds sasl.oauthbearer.assertion.claim.sub
sasl.oauthbearer.assertion.jwt.template.file sasl.oauthbearer.metadata.authentication.type plugin.library.paths
group.id group.instance.id partition.assignment.strategy session.timeout.ms heartbeat.interval.ms
group.protocol.type group.protocol group.remote.assignor coordinator.query.interval.ms max.poll.interval.ms
enable.auto.commit auto.commit.interval.ms enable.auto.offset.store queued.min.messages queued.max.messages.kbytes
fetch.wait.max.ms fetch.queue.backoff.ms fetch.message.max.bytes max.partition.fetch.bytes fetch.max.bytes
fetch.min.bytes fetch.error.backoff.ms offset.store.method isolation.level enable.partition.eof check.crcs
client.rack max.poll.records retry.backoff.ms retry.backoff.max.ms client.dns.lookup enable.metrics.push
auto.commit.enable auto.offset.reset offset.store.path offset.store.sync.interval.ms consume.callback.max.messages
"""
LIBRDKAFKA_OPTIONS = frozenset(_NAMES.split())

#: librdkafka options that have a kstore setting of their own: name -> that setting.
_OWN_SETTING = {
    "bootstrap.servers": "bootstrap_servers",
    "metadata.broker.list": "bootstrap_servers",
    "client.id": "client_id",
    "max.poll.records": "max_poll_records",
    "session.timeout.ms": "session_timeout_ms",
    "heartbeat.interval.ms": "heartbeat_interval_ms",
    "max.poll.interval.ms": "max_poll_interval_ms",
    "security.protocol": "security_protocol",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.username": "sasl_username",
    "sasl.password": "sasl_password",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_key_password",
    "ssl.endpoint.identification.algorithm": "ssl_check_hostname",
}
_NEVER_IN_KAFKA = "offsets live in the database, never in Kafka"
#: librdkafka options kstore must control itself: name -> why.
_KSTORE_CONTROLS = {
    "group.id": "the group is the processor's (--group)",
    "group.instance.id": "static membership lets a restarted worker take back its partitions without a "
                         "rebalance, so the group's leader never checks which database it writes to "
                         "(one pipeline, one database)",
    "group.protocol": "use rebalance_protocol (eager, cooperative or consumer)",
    "group.protocol.type": "use rebalance_protocol (eager, cooperative or consumer)",
    "group.remote.assignor": "with rebalance_protocol consumer the broker's group.consumer.assignors decide",
    "partition.assignment.strategy": "use rebalance_protocol (eager, cooperative or consumer)",
    "enable.auto.commit": _NEVER_IN_KAFKA,
    "auto.commit.enable": _NEVER_IN_KAFKA,
    "auto.commit.interval.ms": _NEVER_IN_KAFKA,
    "enable.auto.offset.store": _NEVER_IN_KAFKA,
    "offset.store.method": _NEVER_IN_KAFKA,
    "offset.store.path": _NEVER_IN_KAFKA,
    "offset.store.sync.interval.ms": _NEVER_IN_KAFKA,
    "auto.offset.reset": "a partition with no stored offset starts at start_from",
    "allow.auto.create.topics": "kstore never creates topics",
    "enable.partition.eof": "the worker polls until it is stopped",
}
ISOLATION_LEVELS = ("read_committed", "read_uncommitted")


def refuse_reserved(raw_name: str, name: str, own_setting: Mapping[str, str], controls: Mapping[str, str]) -> None:
    """Refuse a Kafka option (by either client's name) that kstore has a setting for, or sets itself."""
    if name in own_setting:
        setting = own_setting[name]
        raise ConfigurationError(
            f"Kafka option {raw_name!r} has a kstore setting of its own: use {setting} (KSTORE_{setting.upper()})"
        )
    if name in controls:
        raise ConfigurationError(f"Kafka option {raw_name!r} is kstore's to set: {controls[name]}")


def check_librdkafka_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``kafka_options`` by librdkafka name; values become librdkafka's text.

    ``fetch_max_bytes`` (as a ``KSTORE_KAFKA_FETCH_MAX_BYTES`` variable gives it) is read as
    ``fetch.max.bytes``. Raises :class:`ConfigurationError` for an unknown name, or one kstore
    controls or has its own setting for.
    """
    checked: dict[str, Any] = {}
    for raw_name, value in options.items():
        name = librdkafka_name(raw_name)
        refuse_reserved(raw_name, name, _OWN_SETTING, _KSTORE_CONTROLS)
        if name not in LIBRDKAFKA_OPTIONS:
            raise ConfigurationError(f"unknown Kafka option {raw_name!r} (not a librdkafka consumer property; "
                                     "kafka_client is confluent)")
        checked[name] = _text(value)
    level = checked.get("isolation.level")
    if level is not None and level not in ISOLATION_LEVELS:
        raise ConfigurationError(f"Kafka option isolation.level must be {' or '.join(ISOLATION_LEVELS)}, got {level!r}")
    return checked


def librdkafka_name(raw: str) -> str:
    """A librdkafka property's name from how a user may write it: ``fetch_max_bytes``, ``Fetch.Max.Bytes``."""
    name = raw.strip().lower()
    if name in LIBRDKAFKA_OPTIONS or name in _OWN_SETTING or name in _KSTORE_CONTROLS:
        return name
    return name.replace("_", ".").replace("-", ".")


def _text(value: Any) -> Any:
    """librdkafka parses every value from text: booleans as ``true``/``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value.strip()
    raise ConfigurationError(f"a librdkafka option is text, a number or a boolean, not {type(value).__name__}")
