"""A dead letter's page on SQLite, through Starlette's test client: any letter (megabytes, binary,
odd text) is shown small, downloaded whole, acted on, and edited byte for byte."""

from __future__ import annotations

import base64
import html
import itertools
import json
import re
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from kstore import Message, Processor, Settings, migrate
from kstore.console import app, state
from kstore.db import deadletters
from kstore.db.store import make_engine
from tests.support.console_pages import csrf_of

PASSWORD = "letter-page-Pa55word"
GROUP = "orders"
#: The letter page's HTML, whatever the letter holds, stays under this.
SMALL_PAGE = 64 * 1024
#: More than the edit form takes in a field (a value as large as Kafka takes, as a browser sends it).
OVER_THE_EDIT_FORM = 7 * 1024 * 1024
#: Each letter its own offset.
_OFFSETS = itertools.count(1)

kept = sa.Table("kept", sa.MetaData(),
                sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                sa.Column("kafka_offset", sa.BigInteger, nullable=False),
                sa.Column("value", sa.LargeBinary))


class Keeper(Processor):
    """Keeps each message's value as it got it: one row a message."""

    group = GROUP

    def setup(self) -> None:
        kept.metadata.create_all(self.engine)

    def handle(self, msg: Message) -> None:
        self.session.execute(sa.insert(kept).values(kafka_offset=msg.offset, value=msg.value))


@pytest.fixture
def dsn(tmp_path: Path) -> str:
    dsn = f"sqlite:///{tmp_path / 'kstore.db'}"
    migrate(Settings(dsn=dsn))
    return dsn


def _insert(dsn: str, value: bytes | None, *, key: bytes | None = b"k", group: str = GROUP,
            headers: Sequence[tuple[str, bytes | None]] = (), at: datetime | None = None) -> int:
    at = at or datetime.now(timezone.utc)
    engine = make_engine(Settings(dsn=dsn))
    t = deadletters.build_table()
    with engine.begin() as conn:
        found = conn.execute(t.insert().values(
            consumer_group=group, topic="t", partition_id=0, offset=next(_OFFSETS), key=key, value=value,
            headers=json.dumps([[k, None if v is None else base64.b64encode(v).decode()] for k, v in headers]),
            timestamp=at, error="ValueError: bad order", traceback="Traceback ...", attempts=1,
            first_failure_at=at, last_failure_at=at, status=deadletters.DEAD))
    engine.dispose()
    return int(found.inserted_primary_key[0])



def _client(dsn: str, **settings: Any) -> Iterator[TestClient]:
    web = app(Settings(dsn=dsn, bootstrap_servers="127.0.0.1:1", console_sample_interval_s=0,
                       console_password=PASSWORD, **settings), processors={GROUP: Keeper()})
    with TestClient(web, base_url="http://127.0.0.1") as client:
        _log_in(client)
        yield client


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    yield from _client(dsn)


def _log_in(client: TestClient) -> None:
    token = csrf_of(client.get("/login").text)
    r = client.post("/login", data={"csrf_token": token, "operator": "ann", "password": PASSWORD},
                    follow_redirects=False)
    assert r.status_code == 303


def _page(client: TestClient, letter_id: int, tail: str = "") -> str:
    r = client.get(f"/groups/{GROUP}/dead-letters/{letter_id}{tail}")
    assert r.status_code == 200, r.text[:2000]
    return r.text


def _act(client: TestClient, letter_id: int, action: str, **fields: str) -> Any:
    token = csrf_of(_page(client, letter_id))
    return client.post(f"/groups/{GROUP}/dead-letters/{letter_id}/{action}",
                       data={"csrf_token": token, "reason": "by hand", **fields})


def _status(dsn: str, letter_id: int) -> str:
    return deadletters.show_dead_letter(Settings(dsn=dsn), letter_id)[0].status


def _history(dsn: str, letter_id: int) -> list[deadletters.Change]:
    return deadletters.show_dead_letter(Settings(dsn=dsn), letter_id)[1]


def _kept(dsn: str) -> list[bytes | None]:
    engine = make_engine(Settings(dsn=dsn))
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("kept"):
                return []
            return [None if v is None else bytes(v) for v in conn.execute(sa.select(kept.c.value).order_by(kept.c.id))
                    .scalars()]
    finally:
        engine.dispose()


def _edit_form(page: str) -> dict[str, str]:
    """The edit page's form as a browser sends it: the box's text as HTML parses it (the line
    break right after the tag dropped) with its line breaks sent as CR LF."""
    box = re.search(r'<textarea[^>]*id="edited-value"[^>]*>(.*?)</textarea>', page, re.S)
    encoding = re.search(r'name="encoding" value="([^"]*)"', page)
    assert box and encoding, page[:3000]
    text = html.unescape(box.group(1))
    text = text[1:] if text.startswith("\n") else text
    return {"csrf_token": csrf_of(page), "edit": "on", "encoding": encoding.group(1),
            "value": text.replace("\n", "\r\n"), "reason": "edited"}


def _replay_edited(client: TestClient, letter_id: int, change: Any = None) -> Any:
    """Open the edit page, change the box's text with ``change`` (or not), and submit it."""
    form = _edit_form(_page(client, letter_id, "/edit"))
    if change is not None:
        form["value"] = change(form["value"])
    return client.post(f"/groups/{GROUP}/dead-letters/{letter_id}/replay", data=form)


@pytest.mark.parametrize("size", [1_000_000, 3_000_000])
def test_a_letter_of_megabytes_is_discarded_resolved_and_replayed_from_a_page_that_stays_small(
        client: TestClient, dsn: str, size: int) -> None:
    value = (b"0123456789abcdef" * (size // 16 + 1))[:size]
    discard, resolve, replay = (_insert(dsn, value) for _ in range(3))
    page = _page(client, discard)
    assert len(page.encode()) < SMALL_PAGE
    assert f"{size:,} bytes; the first 4,096 of {size:,} characters shown" in page

    r = _act(client, discard, "discard")
    assert r.status_code == 200 and f"discarded dead letter {discard}" in r.text and len(r.content) < SMALL_PAGE
    r = _act(client, resolve, "resolve")
    assert r.status_code == 200 and f"resolved dead letter {resolve}" in r.text
    r = _act(client, replay, "replay")
    assert r.status_code == 200 and f"replayed dead letter {replay}" in r.text
    assert [_status(dsn, i) for i in (discard, resolve, replay)] == ["discarded", "resolved", "replayed"]
    assert _kept(dsn) == [value]


def test_the_download_links_give_the_key_and_value_byte_for_byte(client: TestClient, dsn: str) -> None:
    key, value = bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 5000
    letter_id = _insert(dsn, value, key=key)
    page = _page(client, letter_id)
    for part, data in (("key", key), ("value", value)):
        link = re.search(rf'id="{part}-download" href="([^"]+)"', page)
        assert link, part
        r = client.get(html.unescape(link.group(1)))
        assert r.status_code == 200 and r.content == data, part
        assert r.headers["content-type"] == "application/octet-stream"
        assert r.headers["content-disposition"] == f'attachment; filename="dead-letter-{letter_id}-{part}.bin"'

    keyless = _insert(dsn, b"v", key=None)
    assert 'id="key-download"' not in _page(client, keyless)
    assert client.get(f"/groups/{GROUP}/dead-letters/{keyless}/key").status_code == 404


ODD_VALUES = {
    "not UTF-8": bytes(range(256)),
    "CRLF": b"first line\r\nsecond line\r\n",
    "NUL": b"before\x00after",
    "a leading newline": b"\nafter a blank first line\n",
    "tabs and accents": "na\u00efve\tcaf\u00e9\n\u2603".encode(),
    "HTML": b"</textarea><b>&amp;</b>",
    "empty": b"",
}


@pytest.mark.parametrize("value", ODD_VALUES.values(), ids=ODD_VALUES.keys())
def test_an_edit_submitted_unchanged_replays_the_original_bytes_and_records_no_edit(
        client: TestClient, dsn: str, value: bytes) -> None:
    letter_id = _insert(dsn, value)
    r = _replay_edited(client, letter_id)
    assert r.status_code == 200 and f"replayed dead letter {letter_id}" in r.text and "edited value" not in r.text
    assert _kept(dsn) == [value]
    assert [c.edited for c in _history(dsn, letter_id)] == [False]


@pytest.mark.parametrize("value", [b"\r\n", b"nul\x00", bytes(range(256))], ids=["CRLF", "NUL", "not UTF-8"])
def test_a_value_a_form_would_change_is_shown_and_edited_as_base64(
        client: TestClient, dsn: str, value: bytes) -> None:
    letter_id = _insert(dsn, value)
    page = _page(client, letter_id)
    assert 'id="value-encoding"' in page and "shown as base64" in page
    assert base64.b64encode(value).decode()[:60] in page
    edit = _page(client, letter_id, "/edit")
    assert 'name="encoding" value="base64"' in edit and 'id="edit-encoding"' in edit


def test_a_value_edited_as_base64_replays_exactly_the_bytes_given(client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, bytes(range(256)))
    wanted = b"\xff\xfe\x00\r\n\r\x80 replaced" * 20
    encoded = base64.b64encode(wanted).decode()
    lines = "\r\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
    r = _replay_edited(client, letter_id, lambda _box: lines)
    assert f"replayed dead letter {letter_id} with the edited value" in r.text
    assert _kept(dsn) == [wanted]
    [change] = _history(dsn, letter_id)
    assert change.edited and bytes(change.replayed_value or b"") == wanted


def test_a_text_edit_keeps_its_line_breaks_and_a_leading_newline_exactly(client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, b"\nfirst\nsecond\n")
    r = _replay_edited(client, letter_id, lambda box: box.replace("second", "third"))
    assert f"replayed dead letter {letter_id} with the edited value" in r.text
    assert _kept(dsn) == [b"\nfirst\nthird\n"]


def test_bad_base64_is_an_error_on_the_edit_page_and_nothing_is_replayed(client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, bytes(range(256)))
    for bad in ("not base64!", "QUJD=", "QUJ"):
        r = _replay_edited(client, letter_id, lambda _box, bad=bad: bad)
        assert r.status_code == 400 and 'id="error"' in r.text and "is not base64" in r.text, bad
        assert "nothing was replayed" in r.text and 'id="edited-value"' in r.text
    assert _status(dsn, letter_id) == deadletters.DEAD and _history(dsn, letter_id) == [] and _kept(dsn) == []


def test_an_edited_value_as_large_as_kafka_takes_is_replayed_byte_for_byte(client: TestClient, dsn: str) -> None:
    value = (b"line of an order\n" * 70_000)[:1_048_576]
    letter_id = _insert(dsn, value)
    r = _replay_edited(client, letter_id, lambda box: box.replace("line", "LINE", 1))
    assert f"replayed dead letter {letter_id} with the edited value" in r.text
    assert _kept(dsn) == [value.replace(b"line", b"LINE", 1)]


def test_an_edit_larger_than_the_console_takes_is_refused_on_a_page_and_nothing_is_replayed(
        client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, b"small")
    form = _edit_form(_page(client, letter_id, "/edit"))
    r = client.post(f"/groups/{GROUP}/dead-letters/{letter_id}/replay",
                    data={**form, "value": "x" * OVER_THE_EDIT_FORM})
    assert r.status_code == 413 and 'id="refused"' in r.text and "--value-file" in r.text
    assert _status(dsn, letter_id) == deadletters.DEAD and _kept(dsn) == []


def test_a_value_larger_than_kafka_takes_is_not_offered_for_editing(client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, b"x" * 3_000_000)
    edit = _page(client, letter_id, "/edit")
    assert 'id="too-large"' in edit and "--value-file" in edit and "<textarea" not in edit
    assert len(edit.encode()) < SMALL_PAGE


def test_headers_are_a_table_of_names_and_values_escaped_and_binary_ones_in_base64(
        client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, b"v", headers=[("trace-id", b"abc-123"), ("raw", b"\xff\x00"), ("absent", None),
                                            ("<b>name</b>", b"<script>alert(1)</script>")])
    page = _page(client, letter_id)
    table = re.search(r'<table id="headers">(.*?)</table>', page, re.S)
    assert table, page
    rows = re.findall(r'<td class="header-name">(.*?)</td><td class="header-value">(.*?)</td>', table.group(1))
    assert [(name, re.sub(r"<[^>]+>", "", v)) for name, v in rows] == [
        ("trace-id", "abc-123"), ("raw", "/wA= (not UTF-8 text: base64)"), ("absent", "(null)"),
        ("&lt;b&gt;name&lt;/b&gt;", "&lt;script&gt;alert(1)&lt;/script&gt;")]
    assert "<script>" not in page and "(b'" not in page


def test_the_letters_times_are_shown_in_utc_with_their_zone(client: TestClient, dsn: str) -> None:
    letter_id = _insert(dsn, b"v", at=datetime(2026, 1, 31, 8, 0, 5, tzinfo=timezone.utc))
    page = _page(client, letter_id)
    for cell in ("timestamp", "first-failure", "last-failure"):
        assert f'<td id="{cell}">2026-01-31T08:00:05Z</td>' in page, cell


def test_a_letter_of_another_group_is_not_found_on_its_page_and_nothing_is_done_to_it(
        client: TestClient, dsn: str) -> None:
    mine = _insert(dsn, b"mine")
    theirs = _insert(dsn, b"theirs", group="payments")
    token = csrf_of(_page(client, mine))
    for tail in ("", "/edit", "/key", "/value"):
        r = client.get(f"/groups/{GROUP}/dead-letters/{theirs}{tail}")
        assert r.status_code == 404 and 'id="refused"' in r.text and "theirs" not in r.text, tail
    for action, extra in (("discard", {}), ("resolve", {}), ("replay", {}),
                          ("replay", {"edit": "on", "encoding": "text", "value": "changed"})):
        r = client.post(f"/groups/{GROUP}/dead-letters/{theirs}/{action}",
                        data={"csrf_token": token, "reason": "not mine", **extra})
        assert r.status_code == 404 and 'id="refused"' in r.text, action
    assert _status(dsn, theirs) == deadletters.DEAD and _history(dsn, theirs) == [] and _kept(dsn) == []
    assert client.get(f"/groups/{GROUP}/dead-letters/{theirs + 100}").status_code == 404


WIRE = b"\x00\x00\x00\x00\x07avro bytes"


def _decoded(_registry: object, data: bytes | None) -> tuple[str, Any] | None:
    """A registry that knows one value: WIRE, an order."""
    return ("avro, schema id 7", {"n": 7, "kind": "crash"}) if data == WIRE else None


def test_a_value_decoded_with_its_schema_is_edited_as_json_and_unchanged_replays_as_written(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "decoded_for_display", _decoded)
    monkeypatch.setattr(state.Registry, "of", classmethod(lambda _cls, _settings: object()))
    unchanged, edited = _insert(dsn, WIRE), _insert(dsn, WIRE)
    for client in _client(dsn, schema_registry_url="http://127.0.0.1:1"):
        edit = _page(client, unchanged, "/edit")
        assert 'name="encoding" value="json"' in edit and "avro, schema id 7" in edit
        r = _replay_edited(client, unchanged)
        assert f"replayed dead letter {unchanged}" in r.text and "edited value" not in r.text
        r = _replay_edited(client, edited, lambda box: box.replace('"crash"', '"fixed"'))
        assert f"replayed dead letter {edited} with the edited value" in r.text
    # Keeper reads bytes, so the edit reaches it as the JSON text given (a registry format's
    # processor has it written with the letter's schema: kstore.schemas.formats.encode_like).
    first, second = _kept(dsn)
    assert first == WIRE and json.loads(second or b"") == {"n": 7, "kind": "fixed"}


def test_a_letter_whose_replay_failed_otherwise_shows_the_error_that_made_it_dead(client: TestClient,
                                                                                   dsn: str) -> None:
    letter_id = _insert(dsn, b"v")
    with deadletters.DeadLetters(Settings(dsn=dsn)) as letters:
        letters.note_failure(letters.get(letter_id), KeyError("sku"), "tried")
    page = _page(client, letter_id)
    assert 'id="letter-error">KeyError: &#39;sku&#39;<' in page
    assert 'id="letter-first-error">ValueError: bad order<' in page
