"""`kstore worker`'s signal handling (kstore.cli.worker): the shutdown alarm bounds every batch after a stop."""

from __future__ import annotations

import signal

from kstore.cli import worker as kstore_cli


def test_the_shutdown_alarm_repeats_after_the_first_timeout() -> None:
    """The SIGALRM timer fired once; a batch begun after it was no longer bounded."""

    class FakeWorker:
        busy = False

        def request_stop(self) -> None:
            pass

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    try:
        kstore_cli._install_signals(FakeWorker(), 5.0)  # type: ignore[arg-type]
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        handler(signal.SIGTERM, None)
        value, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 4 < value <= 5 and interval == 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in old.items():
            signal.signal(s, h)
