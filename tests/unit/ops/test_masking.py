"""Hiding secrets by where they stand (kstore.ops.masking): a DSN's password, a ``password=``
value, a secret Kafka option, never an ordinary word. What kstore's commands print with any
password: tests/integration/security/test_secret_masking.py."""

from __future__ import annotations

from kstore.ops.masking import Masker


def test_masker_hides_credential_positions_only() -> None:
    masker = Masker(["p", "postgres", "p w", "a@b"])
    assert masker.mask("imported p, expected postgres") == "imported p, expected postgres"
    assert (masker.mask('password authentication failed for user "postgres"')
            == 'password authentication failed for user "postgres"')
    assert masker.mask("at postgresql://postgres:postgres@h/db now") == "at postgresql://postgres:***@h/db now"
    assert masker.mask("postgresql://u:p w@h/db") == "postgresql://u:***@h/db"
    assert masker.mask("postgresql://u:a@b@h/db") == "postgresql://u:***@h/db"
    assert masker.mask("conninfo password=p w, port=1") == "conninfo password=***, port=1"
    assert masker.mask("{'sasl.password': 'a@b', 'acks': 1}") == "{'sasl.password': ***, 'acks': 1}"
    assert masker.mask("http://host:8080/path") == "http://host:8080/path"
    # A password it was not told about is hidden all the same where it stands.
    assert Masker().mask("postgresql://u:unknown@h/db") == "postgresql://u:***@h/db"
