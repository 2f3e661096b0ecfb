"""The benchmark's command line (benchmarks/cli.py): options it refuses in one line."""

from __future__ import annotations

import pytest

from benchmarks.cli import parse


def test_a_negative_db_latency_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--db-latency-ms", "-1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--db-latency-ms cannot be negative")
