"""Loading a processor (kstore.running.loading.load_processor) as `kstore worker` names it."""

from __future__ import annotations

from pathlib import Path

from kstore import load_processor


def test_a_processor_given_as_a_file_path(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "rules.py").write_text("LIMIT = 10\n")
    (app / "ledger.py").write_text(
        "from kstore import Processor\nfrom rules import LIMIT\n\n"
        "class Ledger(Processor):\n    group = 'ledger'\n    topics = ['transfers']\n    limit = LIMIT\n\n"
        "    def handle(self, msg):\n        pass\n")
    processor = load_processor(f"{app / 'ledger.py'}:Ledger")
    assert type(processor).__name__ == "Ledger" and processor.limit == 10  # type: ignore[attr-defined]
