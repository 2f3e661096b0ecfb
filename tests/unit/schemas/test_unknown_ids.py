"""An unknown schema id is weighed against what the registry knows before the record is blamed: a
registry that knows no schema at all, none of the record's topic, or several ids in a row is an outage;
one unknown id among known ones stays the record's fault. On a registry that counts what it is asked."""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import Schema

from kstore.errors import RegistryUnavailableError
from kstore.schemas import Formats, Registry
from kstore.schemas.registry import UnknownSchemaError
from kstore.schemas.unknown import DISTINCT_IDS_IN_A_ROW, SUBJECTS_TTL_S, UnknownIds
from tests.support.schema_data import ORDER_V1

URL = "http://registry:8081"


class FakeRegistry:
    """A registry with the given subjects, counting how often it is asked them."""

    def __init__(self, *subjects: str, url: str = URL) -> None:
        self.url = url
        self.listed = list(subjects)
        self.asked = 0
        self.down = False

    def subjects(self) -> list[str]:
        self.asked += 1
        if self.down:
            raise RegistryUnavailableError(f"the schema registry at {self.url} does not answer (ConnectError)")
        return list(self.listed)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def judge(clock: Clock) -> UnknownIds:
    return UnknownIds(clock=clock)


def test_an_empty_registry_is_an_outage_naming_the_registry_the_topic_and_the_id(judge: UnknownIds) -> None:
    outage = judge.weigh(FakeRegistry(), "orders", 1)

    assert isinstance(outage, RegistryUnavailableError)
    assert str(outage) == ("the schema registry at http://registry:8081 knows no schema at all (is it the right "
                           "registry, or was it emptied?): the records of topic orders name schema id 1")


def test_an_emptied_registry_is_an_outage_even_for_a_topic_that_decoded_before(judge: UnknownIds) -> None:
    judge.decoded({"orders"})

    assert judge.weigh(FakeRegistry(), "orders", 1) is not None


def test_a_registry_of_other_topics_only_is_an_outage_for_this_topic(judge: UnknownIds) -> None:
    outage = judge.weigh(FakeRegistry("payments-value", "payments-key"), "orders", 12)

    assert outage is not None
    assert str(outage) == ("the schema registry at http://registry:8081 knows no schema for topic orders (is it the "
                           "right registry, or was it emptied?): its records name schema id 12")


def test_a_topic_whose_name_only_begins_another_topics_subject_is_not_known(judge: UnknownIds) -> None:
    assert judge.weigh(FakeRegistry("orders-eu-value"), "orders", 3) is not None


def test_one_unknown_id_among_known_ones_is_the_records_fault(judge: UnknownIds) -> None:
    registry = FakeRegistry("orders-value")

    assert judge.weigh(registry, "orders", 4242) is None
    judge.decoded({"orders"})
    assert judge.weigh(registry, "orders", 4243) is None


def test_the_same_unknown_id_again_and_again_stays_the_records_fault(judge: UnknownIds) -> None:
    registry = FakeRegistry("orders-value")

    assert all(judge.weigh(registry, "orders", 4242) is None for _ in range(100))


def test_several_different_unknown_ids_in_a_row_are_an_outage(judge: UnknownIds) -> None:
    registry = FakeRegistry("orders-value")
    ids = range(500, 500 + DISTINCT_IDS_IN_A_ROW)

    verdicts = [judge.weigh(registry, "orders", schema_id) for schema_id in ids]

    assert verdicts[:-1] == [None] * (DISTINCT_IDS_IN_A_ROW - 1)
    assert verdicts[-1] is not None
    assert str(verdicts[-1]) == ("the schema registry at http://registry:8081 knows none of 3 different schema ids "
                                 "the records of topic orders named in a row (is it the right registry, or did it "
                                 "lose schemas?): 500, 501, 502")
    # It lasts while nothing of the topic decodes: the first id of the row, retried, is an outage too.
    assert judge.weigh(registry, "orders", 500) is not None


def test_a_record_that_decodes_ends_the_row_of_unknown_ids(judge: UnknownIds) -> None:
    registry = FakeRegistry("orders-value")
    for schema_id in (1, 2):
        assert judge.weigh(registry, "orders", schema_id) is None
    judge.decoded({"orders"})

    assert [judge.weigh(registry, "orders", schema_id) for schema_id in (3, 4)] == [None, None]


def test_rows_are_counted_per_topic(judge: UnknownIds) -> None:
    registry = FakeRegistry("orders-value", "refunds-value")

    verdicts = [judge.weigh(registry, topic, schema_id)
                for topic, schema_id in (("orders", 1), ("refunds", 2), ("orders", 3), ("refunds", 4))]

    assert verdicts == [None] * 4


def test_the_outage_says_the_same_for_every_record_while_it_lasts(judge: UnknownIds) -> None:
    registry = FakeRegistry()

    texts = {str(judge.weigh(registry, "orders", schema_id)) for schema_id in (7, 8, 9, 7, 10)}

    assert len(texts) == 1 and "schema id 7" in texts.pop()  # one log line, one /readyz reason


def test_a_registry_of_record_named_subjects_cannot_say_the_topic_is_not_its(judge: UnknownIds) -> None:
    assert judge.weigh(FakeRegistry("kstore.test.Order"), "orders", 4242) is None


def test_a_topic_record_named_subject_counts_as_the_topics(judge: UnknownIds) -> None:
    assert judge.weigh(FakeRegistry("payments-value", "orders-kstore.test.Order"), "orders", 4242) is None


def test_a_topic_that_decoded_with_the_registry_is_its_whatever_the_subjects_names(judge: UnknownIds) -> None:
    judge.decoded({"orders"})

    assert judge.weigh(FakeRegistry("payments-value"), "orders", 4242) is None


def test_the_subjects_are_asked_at_most_once_per_ttl(judge: UnknownIds, clock: Clock) -> None:
    registry = FakeRegistry("orders-value")
    for schema_id in range(1000):
        judge.weigh(registry, "orders", 4242)
        judge.decoded({"orders"} if schema_id % 2 else ())
    assert registry.asked == 1

    clock.now += SUBJECTS_TTL_S
    registry.listed = []
    assert judge.weigh(registry, "orders", 4242) is not None  # emptied since: seen once the answer is old
    assert registry.asked == 2


def test_a_registry_that_does_not_answer_for_its_subjects_is_that_outage(judge: UnknownIds) -> None:
    registry = FakeRegistry("orders-value")
    registry.down = True

    with pytest.raises(RegistryUnavailableError, match="does not answer"):
        judge.weigh(registry, "orders", 4242)


def test_an_unknown_id_raised_without_its_registry_stays_the_records_fault(judge: UnknownIds) -> None:
    assert judge.blame("orders", UnknownSchemaError("schema id 5 is not in the schema registry")) is None


def test_the_registrys_unknown_id_error_says_its_id_and_registry_for_the_judge() -> None:
    registry = Registry.in_memory()
    registry.client.register_schema("payments-value", Schema(ORDER_V1, "AVRO"))
    with pytest.raises(UnknownSchemaError) as raised:
        Formats(value_format="avro", registry=lambda: registry).decode(None, b"\x00" + (4242).to_bytes(4, "big"))

    assert (raised.value.schema_id, raised.value.registry) == (4242, registry)
    assert registry.subjects() == ["payments-value"]
    outage = UnknownIds().blame("orders", raised.value)
    assert outage is not None and "knows no schema for topic orders" in str(outage)
    assert str(outage).endswith("its records name schema id 4242")
