"""examples/shop_web.py as its docstring runs it: concurrent requests place orders over HTTP (Starlette's
test client, the app's own lifespan), bad requests are refused with 422, and ``kstore relay --outbox
shop-web`` publishes each placed order once, per customer in commit order."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from tests.support.harness import WorkerProcess, read_committed, wait_until

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "shop_web.py"


def load_app(monkeypatch: pytest.MonkeyPatch, dsn: str, topic: str) -> Any:
    monkeypatch.setenv("KSTORE_DSN", dsn)
    monkeypatch.setenv("SHOP_ORDER_TOPIC", topic)
    spec = importlib.util.spec_from_file_location("shop_web_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shop_announces_each_placed_order_once_in_commit_order(
        pg_dsn: str, new_topic: Any, kafka: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = new_topic(partitions=3)
    shop = load_app(monkeypatch, pg_dsn, out)
    placed: list[dict[str, Any]] = []
    refused: list[int] = []
    with TestClient(shop.app) as client:
        relay = WorkerProcess(["relay", "--dsn", pg_dsn, "--outbox", "shop-web", "--bootstrap-servers", kafka],
                              {}, tmp_path / "relay.log")
        try:
            def customer(t: int) -> None:
                for i in range(10):
                    r = client.post("/orders", json={"customer": f"c-{(t * 10 + i) % 7}", "amount": 100 + i})
                    assert r.status_code == 201, r.text
                    placed.append(r.json())
                refused.append(client.post("/orders", json={"customer": "c-1", "amount": -5}).status_code)

            threads = [threading.Thread(target=customer, args=(t,)) for t in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert refused == [422] * 20 and len(placed) == 200
            engine = sa.create_engine(pg_dsn)

            def published() -> bool:
                with engine.connect() as conn:
                    return conn.execute(sa.text("SELECT count(*) FROM kstore_outbox")).scalar_one() == 0
            wait_until(published, 90, interval=0.5, what="every order published")
            engine.dispose()
            assert relay.terminate() == 0
        finally:
            relay.cleanup()
    seen = [json.loads(value) for _, value in read_committed(kafka, out)]
    assert sorted(e["order"] for e in seen) == sorted(p["order"] for p in placed), "an order missing or twice"
    per_customer: dict[str, list[int]] = defaultdict(list)
    for e in seen:
        per_customer[e["customer"]].append(e["n"])
    for name, ns in per_customer.items():
        assert ns == list(range(1, len(ns) + 1)), f"{name}'s orders out of commit order"
