"""The worker's process-wide tuning (kstore.engine.worker)."""

from __future__ import annotations

import gc

import pytest

from kstore.engine.worker import GC_YOUNG_THRESHOLD, PYTHON_GC_THRESHOLDS, tune_collector


@pytest.mark.parametrize(("before", "after"), [
    (PYTHON_GC_THRESHOLDS, (GC_YOUNG_THRESHOLD, *PYTHON_GC_THRESHOLDS[1:])),
    ((1000, 5, 5), (1000, 5, 5)),  # the process chose its own: left alone
])
def test_a_worker_raises_the_collectors_young_threshold_unless_the_process_set_its_own(
        before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
    saved = gc.get_threshold()
    try:
        gc.set_threshold(*before)
        tune_collector()
        assert gc.get_threshold() == after
    finally:
        gc.set_threshold(*saved)
