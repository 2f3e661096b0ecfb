"""Unit tests of the confluent-kafka backend's settings: choosing the client, librdkafka option names,
kstore's security settings as librdkafka properties, the records it queues. Nothing here connects."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, KafkaError, KafkaException, Message

from kstore import ConfigurationError, Settings
from kstore import Message as KstoreMessage
from kstore.kafka.clients import source_class
from kstore.kafka.confluent.connect import librdkafka_config
from kstore.kafka.confluent.consumer import ConfluentSource, by_partition, group_protocol, messages_size, to_messages
from kstore.kafka.kafkapython.consumer import KafkaPythonSource
from kstore.kafka.rdkafkaoptions import LIBRDKAFKA_OPTIONS, check_librdkafka_options, librdkafka_name
from kstore.kafka.seam import RECORD_OVERHEAD
from tests.integration.cli.test_cli import assert_one_clear_line, kstore


def test_every_option_name_kstore_accepts_is_known_to_the_installed_librdkafka() -> None:
    """The names are a copy of librdkafka's list: each one, given a value no property accepts,
    makes librdkafka refuse the value, never the name."""
    unknown = []
    for name in sorted(LIBRDKAFKA_OPTIONS):
        try:
            Consumer({"group.id": "g", name: "\x01not-a-value"}).close()
        except KafkaException as exc:
            if "No such configuration property" in str(exc):
                unknown.append(name)
        except (TypeError, ValueError):
            pass
    assert unknown == []
    with pytest.raises(KafkaException, match="No such configuration property"):
        Consumer({"group.id": "g", "fetch.max.wait.ms": "1"})  # the check above can fail


@pytest.mark.parametrize(("given", "name"), [
    ("fetch.max.bytes", "fetch.max.bytes"),
    ("fetch_max_bytes", "fetch.max.bytes"),  # as KSTORE_KAFKA_FETCH_MAX_BYTES gives it
    (" Fetch.Wait.Max.MS ", "fetch.wait.max.ms"),
    ("log_level", "log_level"),  # one of librdkafka's few names with an underscore
])
def test_librdkafka_names_are_read_as_users_write_them(given: str, name: str) -> None:
    assert librdkafka_name(given) == name


@pytest.mark.parametrize(("options", "expected"), [
    ({"fetch.max.bytes": 1048576}, {"fetch.max.bytes": "1048576"}),
    ({"socket.keepalive.enable": True}, {"socket.keepalive.enable": "true"}),
    ({"fetch_wait_max_ms": " 50 "}, {"fetch.wait.max.ms": "50"}),
    ({"isolation.level": "read_uncommitted"}, {"isolation.level": "read_uncommitted"}),
])
def test_librdkafka_options_become_librdkafkas_text(options: dict[str, Any], expected: dict[str, Any]) -> None:
    assert check_librdkafka_options(options) == expected


@pytest.mark.parametrize(("name", "said"), [
    ("fetch.max.wait.ms", "unknown Kafka option 'fetch.max.wait.ms' (not a librdkafka consumer property"),
    ("fetch_max_wait_ms", "unknown Kafka option 'fetch_max_wait_ms'"),  # kafka-python's name
    ("enable.auto.commit", "is kstore's to set: offsets live in the database"),
    ("enable.auto.offset.store", "is kstore's to set: offsets live in the database"),
    ("auto.offset.reset", "is kstore's to set: a partition with no stored offset starts at start_from"),
    ("group.id", "is kstore's to set"),
    ("partition.assignment.strategy", "is kstore's to set: use rebalance_protocol"),
    ("group.protocol", "is kstore's to set"),
    ("sasl.password", "has a kstore setting of its own: use sasl_password (KSTORE_SASL_PASSWORD)"),
    ("bootstrap.servers", "has a kstore setting of its own: use bootstrap_servers"),
    ("ssl.ca.location", "has a kstore setting of its own: use ssl_cafile"),
    ("session.timeout.ms", "has a kstore setting of its own: use session_timeout_ms"),
])
def test_bad_librdkafka_options_are_one_clear_line(name: str, said: str) -> None:
    with pytest.raises(ConfigurationError, match=_re(said)):
        Settings(kafka_client="confluent", kafka_options={name: "1"})


def test_isolation_level_is_checked() -> None:
    with pytest.raises(ConfigurationError, match=r"isolation\.level must be read_committed or read_uncommitted"):
        Settings(kafka_client="confluent", kafka_options={"isolation.level": "dirty"})


def test_each_client_checks_its_own_option_names() -> None:
    assert Settings(kafka_client="kafka-python", kafka_options={"fetch_max_wait_ms": "50"}).kafka_options == {
        "fetch_max_wait_ms": 50}
    with pytest.raises(ConfigurationError, match="not a kafka-python consumer option"):
        Settings(kafka_client="kafka-python", kafka_options={"fetch.wait.max.ms": "50"})
    assert Settings(kafka_options={"fetch.wait.max.ms": "50"}).kafka_options == {"fetch.wait.max.ms": "50"}
    with pytest.raises(ConfigurationError, match="not a librdkafka consumer property"):
        Settings(kafka_options={"fetch_max_wait_ms": "50"})


def test_the_client_is_a_setting_from_arguments_environment_and_the_command_line() -> None:
    assert Settings().kafka_client == "confluent"
    assert Settings(kafka_client=" Kafka-Python ").kafka_client == "kafka-python"
    with pytest.raises(ConfigurationError, match="kafka_client must be kafka-python or confluent, got 'librdkafka'"):
        Settings(kafka_client="librdkafka")
    # KSTORE_KAFKA_CLIENT is the setting, not a Kafka option named "client"; KSTORE_KAFKA_<NAME> still are.
    env = {"KSTORE_KAFKA_CLIENT": "kafka-python", "KSTORE_KAFKA_FETCH_MAX_WAIT_MS": "50"}
    settings = Settings.from_env(env)
    assert settings.kafka_client == "kafka-python" and settings.kafka_options == {"fetch_max_wait_ms": 50}
    assert Settings.from_env({}, kafka_client="kafka-python").kafka_client == "kafka-python"
    assert Settings.from_env({}).kafka_client == "confluent"


def test_the_cli_takes_the_client() -> None:
    from kstore.cli import cli

    result = CliRunner().invoke(cli, ["worker", "--help"])
    assert "--kafka-client [kafka-python|confluent]" in result.output


def test_the_rebalance_protocol_is_a_setting_and_picks_librdkafkas_group_settings() -> None:
    # Unset: the incremental protocol where the client has one, with a 6 s session.
    assert (Settings().rebalance_protocol, Settings().session_timeout_ms) == ("cooperative", 6000)
    assert Settings(kafka_client="kafka-python").rebalance_protocol == "eager"
    assert Settings.from_env({"KSTORE_REBALANCE_PROTOCOL": " Eager "}).rebalance_protocol == "eager"
    with pytest.raises(ConfigurationError, match="rebalance_protocol must be eager, cooperative or consumer, "
                                                 "got 'sticky'"):
        Settings(kafka_client="confluent", rebalance_protocol="sticky")
    eager = group_protocol(Settings(rebalance_protocol="eager", session_timeout_ms=7000, heartbeat_interval_ms=2000))
    assert eager == {"partition.assignment.strategy": "range", "session.timeout.ms": 7000,
                     "heartbeat.interval.ms": 2000}
    cooperative = group_protocol(Settings())
    assert cooperative["partition.assignment.strategy"] == "cooperative-sticky"
    # KIP-848: librdkafka refuses the classic protocol's session, heartbeat and assignor settings.
    assert group_protocol(Settings(kafka_client="confluent", rebalance_protocol="consumer")) == {
        "group.protocol": "consumer"}


@pytest.mark.parametrize("protocol", ["cooperative", "consumer"])
def test_kafka_python_refuses_an_incremental_protocol_with_one_line(sqlite_dsn: str, protocol: str) -> None:
    with pytest.raises(ConfigurationError, match=f"rebalance_protocol {protocol} needs kafka_client confluent"):
        Settings(kafka_client="kafka-python", rebalance_protocol=protocol)
    r = kstore("worker", "processors:Recorder", "--dsn", sqlite_dsn, "--bootstrap-servers", "127.0.0.1:1",
               "--topic", "t", "--kafka-client", "kafka-python", "--rebalance-protocol", protocol)
    assert_one_clear_line(r, f"rebalance_protocol {protocol} needs kafka_client confluent",
                          "kafka-python backend rebalances eagerly only")


def test_the_worker_builds_the_source_of_its_client() -> None:
    assert source_class(Settings()) is ConfluentSource
    assert source_class(Settings(kafka_client="kafka-python")) is KafkaPythonSource


def test_kafka_python_only_sasl_mechanisms_are_refused_for_confluent() -> None:
    with pytest.raises(ConfigurationError, match="AWS_MSK_IAM is kafka-python's only"):
        Settings(kafka_client="confluent", security_protocol="SASL_SSL", sasl_mechanism="AWS_MSK_IAM")


def test_security_settings_become_librdkafka_properties(tmp_path: Path) -> None:
    settings = Settings(kafka_client="confluent", bootstrap_servers="b1:9093,b2:9093", security_protocol="SASL_SSL",
                        sasl_mechanism="SCRAM-SHA-512", sasl_username="u", sasl_password="p",
                        ssl_cafile=str(tmp_path / "ca.pem"), ssl_certfile=str(tmp_path / "c.pem"),
                        ssl_key_password="k", ssl_check_hostname=False, kafka_options={"fetch.min.bytes": 10})
    config = librdkafka_config(settings)
    assert config == {
        "bootstrap.servers": "b1:9093,b2:9093",
        "security.protocol": "sasl_ssl",
        "socket.connection.setup.timeout.ms": 30000,
        "ssl.ca.location": str(tmp_path / "ca.pem"),
        "ssl.certificate.location": str(tmp_path / "c.pem"),
        "ssl.key.location": str(tmp_path / "c.pem"),  # the key after the certificate, in one file
        "ssl.key.password": "k",
        "ssl.endpoint.identification.algorithm": "none",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "u",
        "sasl.password": "p",
        "fetch.min.bytes": "10",
        "isolation.level": "read_committed",
    }


def test_plaintext_has_no_tls_properties_and_reads_committed_records_only() -> None:
    config = librdkafka_config(Settings(kafka_client="confluent"))
    assert config == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "plaintext",
                      "socket.connection.setup.timeout.ms": 30000, "isolation.level": "read_committed"}


def test_an_oauth_token_provider_becomes_librdkafkas_callback() -> None:
    settings = Settings(kafka_client="confluent", security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                        sasl_oauth_token_provider="tests.unit.kafka.test_kafka_settings:token")
    token, expires = librdkafka_config(settings)["oauth_cb"]("")
    assert token == "a.b.c" and expires > 0


_HEADERS = [("h", b"v")]


def _message(key: bytes | None, value: bytes | None, partition: int = 3, offset: int = 41,
             error: KafkaError | None = None, headers: list[tuple[str, bytes]] | None = _HEADERS) -> Message:
    """A message as confluent-kafka's consume() hands it over (its own class, built for tests)."""
    return Message(topic="t", partition=partition, offset=offset, key=key, value=value, headers=headers,
                   timestamp=(1, 1700000000000), error=error)


def test_a_fetched_message_becomes_the_kstore_message_a_raw_processor_is_handed() -> None:
    """What the fetch thread queues is the :class:`kstore.Message` itself: every field as fetched,
    the timestamp in milliseconds, the headers as pairs."""
    (record, empty) = to_messages([_message(b"k", b"value"), _message(None, None)])
    assert type(record) is KstoreMessage
    assert record == KstoreMessage("t", 3, 41, b"k", b"value", _HEADERS, 1700000000000)
    assert record.timestamp is not None and record.timestamp.year == 2023
    assert (empty.key, empty.value) == (None, None)
    # With one topic subscribed, its name is not asked of each message: the same Messages.
    fetched = [_message(b"k", b"value"), _message(None, None, headers=None)]
    assert to_messages(fetched, "t") == to_messages(fetched)


def test_a_record_without_headers_has_empty_headers_as_a_message_promises() -> None:
    """librdkafka says None for a record without headers; a Message's headers are empty then,
    whether none, some or all of a fetch's records have headers."""
    bare, with_headers = _message(None, b"v", headers=None), _message(None, b"w")
    assert bare.headers() is None
    for fetched in ([bare, bare], [bare, with_headers], [with_headers, bare]):
        got = to_messages(fetched)
        assert [m.headers for m in got] == [() if m is bare else _HEADERS for m in fetched]


@pytest.mark.parametrize("one_topic", [True, False])
def test_fetched_records_are_grouped_by_partition_in_their_order(one_topic: bool) -> None:
    """librdkafka hands over runs of one partition's records, a partition's runs possibly apart:
    each partition's records stay in the order given, none lost or doubled (grouped by partition
    number alone when one topic is subscribed)."""
    order = [(0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (2, 1), (1, 1), (0, 3)]
    grouped = by_partition(to_messages([_message(None, b"v", p, o) for p, o in order]), "t" if one_topic else None)
    assert {tp: [r.offset for r in records] for tp, records in grouped.items()} == {
        ("t", 0): [0, 1, 2, 3], ("t", 1): [0, 1], ("t", 2): [0, 1]}
    assert by_partition([]) == by_partition([], "t") == {}


def test_records_of_two_topics_with_the_same_partition_numbers_are_kept_apart() -> None:
    order = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    fetched = [KstoreMessage(topic, 0, offset, None, b"v") for topic, offset in order]
    grouped = by_partition(fetched)
    assert {tp: [r.offset for r in records] for tp, records in grouped.items()} == {("a", 0): [0, 1], ("b", 0): [0, 1]}


def test_the_size_of_queued_messages_counts_keys_and_values_and_adds_up() -> None:
    """What the buffered-bytes bound adds for a fetch is what it takes away for the same records
    in any split: the running total returns to zero."""
    fetched = to_messages([_message(None, b"v" * 100), _message(b"key", b""), _message(b"k", None)])
    assert messages_size(fetched) == 3 * RECORD_OVERHEAD + 100 + 3 + 1
    assert sum(messages_size(fetched[i:i + 1]) for i in range(3)) == messages_size(fetched)
    assert messages_size([]) == 0


def test_a_fetch_sets_error_messages_apart_and_queues_the_rest() -> None:
    """An error librdkafka hands over among the records is noted, never queued as a record."""
    source = _source(_ScriptedConsumer(0))
    seen: list[Any] = []
    source._fetch_error = lambda msg, error: seen.append((msg.partition(), error.code())) or []  # type: ignore[method-assign,func-returns-value]
    error = KafkaError(KafkaError._AUTO_OFFSET_RESET, "offset out of range")
    source.consumer.script = [_message(None, b"a", 0, 5), _message(None, None, 1, 7, error), _message(None, b"b", 0, 6)]
    fetched = dict(source.fetch(200, 1000).records)
    assert {tp: [r.offset for r in records] for tp, records in fetched.items()} == {("t", 0): [5, 6]}
    assert seen == [(1, KafkaError._AUTO_OFFSET_RESET)]


def _re(text: str) -> str:
    import re
    return re.escape(text)


class _ScriptedConsumer:
    """confluent-kafka's consume(n, timeout) as librdkafka answers it: at once once n messages are
    there (or with the timeout 0), else only when the timeout has passed (on a scripted clock)."""

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        self.waited_s = 0.0
        #: Messages handed over first, whatever is asked (then ``waiting`` more).
        self.script: list[Message] = []

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        if self.script:
            taken, self.script = self.script, []
            return taken
        if self.waiting < num_messages and timeout > 0:
            self.waited_s += timeout
        taken = min(num_messages, self.waiting)
        self.waiting -= taken
        return [_message(b"k", b"v", offset=o) for o in range(taken)]


def _source(consumer: _ScriptedConsumer) -> ConfluentSource:
    source = ConfluentSource.__new__(ConfluentSource)
    source.settings = Settings(max_poll_records=1000)
    source._wishes_lock, source._state_lock = threading.Lock(), threading.Lock()
    source._want_seek, source._want_paused, source._topic = {}, {}, None
    source._assigned, source._paused, source._highwaters = set(), set(), {}
    source.consumer = consumer  # type: ignore[assignment]
    source.member_id = "member-1"  # joined: the fetch does not ask librdkafka for it
    return source


@pytest.mark.parametrize("waiting", [0, 1, 5, 999, 1000, 2500])
def test_a_fetch_hands_over_what_librdkafka_holds_without_waiting_for_a_full_poll(waiting: int) -> None:
    """Fewer messages than max_poll_records are there: the fetch takes them at once. (It asked
    librdkafka for max_poll_records with the poll timeout, which returns only once that many came
    or the timeout passed: at a steady rate every message waited up to the poll timeout.) With
    nothing there, it waits the poll timeout, once, for the first message."""
    source = _source(consumer := _ScriptedConsumer(waiting))
    fetched = [r for _, records in source.fetch(200, 1000).records for r in records]
    assert len(fetched) == min(waiting, 1000)
    assert consumer.waited_s == (0.2 if waiting == 0 else 0.0)


@pytest.mark.parametrize("room", [None, 1, 999, 1000, 5000])
def test_a_fetch_never_takes_more_than_max_poll_records_whatever_room_the_queues_have(room: int | None) -> None:
    """librdkafka may hold far more prefetched than one poll (64 MB by default): a fetch asked for
    more room than max_poll_records still takes at most max_poll_records, the most the queues may
    exceed max_buffered_bytes by."""
    source = _source(_ScriptedConsumer(5000))
    fetched = [r for _, records in source.fetch(200, room).records for r in records]  # type: ignore[arg-type]
    assert len(fetched) == min(room or 1000, 1000)


class _Opened(Exception):
    """Raised by the stand-in for open_rd_consumer once it has seen the consumer's properties."""


@pytest.mark.parametrize("options, expected", [({}, 100), ({"fetch.queue.backoff.ms": "1000"}, "1000")])
def test_librdkafka_refetches_a_partition_soon_after_its_queue_was_full_unless_the_user_says(
        monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], expected: Any) -> None:
    """At librdkafka's default (1000 ms) a drained backlog came in bursts with most of a second
    between them; kstore's consumer asks for 100 ms, and the user's own value wins."""
    seen: dict[str, Any] = {}

    def opened(_settings: Settings, **properties: Any) -> Consumer:
        seen.update(properties)
        raise _Opened

    monkeypatch.setattr("kstore.kafka.confluent.consumer.open_rd_consumer", opened)
    settings = Settings(kafka_client="confluent", kafka_options=options)
    with pytest.raises(_Opened):
        ConfluentSource(settings, "g", ["t"], "worker-1")
    assert seen["fetch.queue.backoff.ms"] == expected
