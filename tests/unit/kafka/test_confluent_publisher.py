"""The confluent-kafka publisher's guard against librdkafka calls that never return (seen after a
broker restart): the transaction runs on a thread of the
publisher's own, and the relay's thread gives up waiting for it. The whole publisher is tested
through a broker restart in tests/integration/outbox/test_outbox.py and
tests/integration/faults_and_in_doubt/test_outages.py."""

from __future__ import annotations

import threading
import time

import pytest

from kstore.kafka.confluent.producer import _Caller


def test_a_call_returns_what_it_raised_on_the_callers_thread() -> None:
    caller = _Caller("t")
    ran_on: list[str] = []
    assert caller.call(lambda: ran_on.append(threading.current_thread().name), 5)
    assert ran_on == ["t"]

    def fail() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        caller.call(fail, 5)
    caller.stop()


def test_a_call_that_does_not_return_is_given_up_on_and_its_thread_left_to_it() -> None:
    caller = _Caller("t")
    release, returned = threading.Event(), threading.Event()

    def hang() -> None:
        release.wait()
        returned.set()

    started = time.monotonic()
    assert caller.call(hang, 0.2) is False
    assert time.monotonic() - started < 5
    thread = next(t for t in threading.enumerate() if t.name == "t")
    assert thread.daemon and thread.is_alive()
    release.set()  # the call returns at last: nobody waits for it, and the thread ends
    assert returned.wait(5)
    thread.join(5)
    assert not thread.is_alive()
