"""docs/configuration.md says which client a ``KSTORE_KAFKA_<NAME>`` variable reaches, and its example
is what Settings does with it on each client (the page is written from the code by scripts/docs-pages)."""

from __future__ import annotations

import re

from kstore import Settings
from tests.support.harness import REPO_DIR


def kafka_variables_entry() -> str:
    page = (REPO_DIR / "docs" / "configuration.md").read_text()
    (entry,) = re.findall(r"^- `KSTORE_KAFKA_<NAME>`:.*?(?=^- |\Z)", page, re.MULTILINE | re.DOTALL)
    return " ".join(entry.split())


def test_the_kafka_variables_entry_names_each_clients_option_as_settings_reads_it() -> None:
    entry = kafka_variables_entry()
    found = re.search(r"With the default `confluent`, a librdkafka property.*?`(KSTORE_KAFKA_\w+)=(\w+)` sets "
                      r"`([\w.]+)`\. With `kafka-python`, a kafka-python consumer option: the same variable sets "
                      r"`(\w+)`", entry)
    assert found, entry
    variable, value, on_librdkafka, on_kafka_python = found.groups()
    for client, option in (("confluent", on_librdkafka), ("kafka-python", on_kafka_python)):
        options = Settings.from_env({"KSTORE_KAFKA_CLIENT": client, variable: value}).kafka_options
        assert list(options) == [option] and str(options[option]) == value, (client, options)
