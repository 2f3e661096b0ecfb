"""How kstore calls a processor's methods and hooks (kstore.running.hooks): what each returned is
checked, so a coroutine behind a plain decorator is refused (and closed, so Python never warns it
was not awaited), and an ``async def`` hook kstore cannot run is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from kstore import ConfigurationError, ProcessorContractError, Worker
from kstore.running.hooks import check_returned
from kstore.testing import make_message, run_batch
from tests.support.contract_processors import WrappedCoroutine
from tests.support.harness import SUPPORT_DIR
from tests.support.processors import AsyncHook, metadata


def test_a_coroutine_handler_behind_a_plain_decorator_is_refused_in_run_batch(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    metadata.create_all(engine)
    with pytest.raises(ProcessorContractError, match="returned coroutine"):
        run_batch(WrappedCoroutine(), [make_message("x", offset=0)], engine)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM effects")).scalar_one() == 0


def test_a_refused_coroutine_is_closed_so_python_never_warns_it_was_not_awaited() -> None:
    """The worker's test (tests/integration/worker/test_batch_transaction.py) asserts that "was never
    awaited" is absent from the worker's output.
    This shows the warning is real when a coroutine is dropped unclosed (the control), and that
    kstore's refusal closes it, so the absence means something."""
    import gc
    import warnings

    async def handle() -> None:
        return None

    with warnings.catch_warnings(record=True) as dropped:
        warnings.simplefilter("always")
        handle()
        gc.collect()
    assert any("was never awaited" in str(w.message) for w in dropped), "the control: no warning to look for"

    with warnings.catch_warnings(record=True) as refused:
        warnings.simplefilter("always")
        with pytest.raises(ProcessorContractError):
            check_returned(WrappedCoroutine(), "handle", handle())
        gc.collect()
    assert not [w for w in refused if "was never awaited" in str(w.message)]


def test_an_async_hook_kstore_cannot_run_is_refused_at_start() -> None:
    with pytest.raises(ConfigurationError, match=r"AsyncHook.on_committed is `async def`"):
        Worker(AsyncHook())
    with pytest.raises(ConfigurationError, match=r"`async def`"):
        run_batch(AsyncHook(), [make_message("x")], "sqlite://")
    r = subprocess.run([sys.executable, "-m", "kstore", "worker", "processors:AsyncHook", "--topic", "t"],
                       capture_output=True, text=True, cwd=SUPPORT_DIR, timeout=60,
                       env={"PYTHONPATH": str(SUPPORT_DIR), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is `async def`" in r.stderr and "Traceback" not in r.stderr
