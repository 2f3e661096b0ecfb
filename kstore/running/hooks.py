"""How kstore calls a processor's hooks, the same for a worker, a dead letter's replay and
:mod:`kstore.testing`: the checks of a processor before it runs (:func:`check_processor`), of what
a hook returned (:func:`check_returned`), ``setup()`` under the group's lock, and a record turned
into the :class:`~kstore.Message` a handler receives (:func:`deserialized`).

Invariant: no hook's coroutine is ever dropped unrun: an ``async def`` is refused where kstore
would call it synchronously, and an awaitable a hook returned stops the batch before it commits.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kstore.db.setuplock import setup_lock
from kstore.db.sqlerrors import first_line
from kstore.errors import ConfigurationError, KstoreError, ProcessorError
from kstore.processor import Processor, _check_returned
from kstore.retry import DeserializationError, Retry
from kstore.types import ORDERINGS, Message

from .concurrency import is_async, run_on_loop

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from kstore.settings import Settings

#: What a hook returned, refused if awaitable: the processor's own check (its default
#: ``handle_batch`` makes it on each ``handle``), which kstore makes on every hook it calls.
check_returned = _check_returned


def to_ms(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


def deserialized(processor: Processor, topic: str, partition: int, offset: int, key: bytes | None,
                 value: bytes | None, headers: Sequence[tuple[str, bytes | None]], timestamp_ms: int | None,
                 ) -> Message:
    """The message as :meth:`Processor.handle` receives it; :class:`DeserializationError` if its key or
    value cannot be deserialized (a :class:`~kstore.retry.Retry` raised by ``deserialize`` passes)."""
    try:
        k, v = processor.deserialize(key, value)
    except Retry:
        raise
    except Exception as exc:
        raise DeserializationError.of(exc) from exc
    return Message(topic, partition, offset, k, v, headers, timestamp_ms)


def declared_topics(processor: Processor) -> frozenset[str] | None:
    """The topics the processor declares it produces to (``produces``), or None if it declares none."""
    produces = processor.produces
    if produces is None:
        return None
    if isinstance(produces, str) or not all(isinstance(t, str) and t for t in produces):
        raise ConfigurationError(f"{type(processor).__name__}.produces must be a list of topic names, "
                                 f"got {produces!r}")
    return frozenset(produces)


def dead_letter_topic(processor: Processor, settings: Settings) -> str | None:
    """The topic each new dead letter is also produced to: the setting's if set (``""``: none), else the
    processor's; None if neither names one."""
    chosen = settings.dead_letter_topic if settings.dead_letter_topic is not None else processor.dead_letter_topic
    return chosen or None


#: The hooks kstore calls; none may be ``async def`` (kstore would get a coroutine it never runs)...
HOOKS = ("setup", "teardown", "on_assigned", "on_revoked", "on_committed", "deserialize", "handle", "handle_batch")
#: ... but these, which kstore runs on the processor's event loop (:mod:`kstore.running.concurrency`).
ASYNC_HOOKS = ("setup", "teardown", "handle", "handle_batch")


def is_async_processor(processor: Processor) -> bool:
    """True if the processor's batches run on its event loop: ``async def handle`` or ``handle_batch``."""
    cls = type(processor)
    return is_async(cls.handle_batch) or (cls.handle_batch is Processor.handle_batch and is_async(cls.handle))


def call_hook(processor: Processor, hook: str, *args: Any) -> Any:
    """Call ``processor.<hook>(*args)`` and check what it returned (see :func:`check_returned`); an
    ``async def setup`` or ``teardown`` runs on the processor's event loop."""
    fn = getattr(processor, hook)
    if hook in ("setup", "teardown") and is_async(fn):
        return run_on_loop(processor, fn(*args))
    result = fn(*args)
    if result is not None:
        check_returned(processor, hook, result)
    return result


def call_setup(processor: Processor, engine: Engine, group: str) -> None:
    """Give the processor ``engine`` and call its ``setup()`` under the group's setup lock
    (:mod:`kstore.db.setuplock`), so the DDL of workers that start together never races.

    What ``setup()`` raises becomes a :class:`~kstore.errors.ProcessorError` naming it (the
    original is its ``__cause__``): a worker or a replay that cannot start says why in one line.
    """
    processor.engine = engine
    with setup_lock(engine, group):
        try:
            call_hook(processor, "setup")
        except KstoreError:
            raise
        except Exception as exc:
            raise ProcessorError(f"{type(processor).__name__}.setup() failed: {type(exc).__name__}: "
                                 f"{first_line(exc)}") from exc


def check_processor(processor: Processor) -> None:
    """Refuse what kstore cannot run: an ``async def`` hook would return a coroutine that never
    runs, and the offsets of its messages would commit with no effect at all. ``async def`` is
    for ``handle``, ``handle_batch``, ``setup`` and ``teardown`` only (:mod:`kstore.running.concurrency`)."""
    cls, name_ = type(processor), type(processor).__name__
    for name in HOOKS:
        fn = getattr(cls, name, None)
        if inspect.isasyncgenfunction(fn) or (inspect.iscoroutinefunction(fn) and name not in ASYNC_HOOKS):
            raise ConfigurationError(
                f"{name_}.{name} is `async def`: kstore calls it synchronously, so its coroutine would never "
                f"run; use `def` (`async def` is for {', '.join(ASYNC_HOOKS)})")
    if is_async(cls.handle) and not is_async(cls.handle_batch) and cls.handle_batch is not Processor.handle_batch:
        raise ConfigurationError(
            f"{name_}.handle is `async def` but its handle_batch is a plain `def`, which would get coroutines "
            "it never runs; make handle_batch `async def` too, or remove it (the default runs handle concurrently)")
    check_concurrency(name_, processor.max_concurrency, processor.ordering)
    declared_topics(processor)


def check_concurrency(where: str, max_concurrency: Any, ordering: Any) -> None:
    if not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigurationError(f"{where}: max_concurrency must be a positive int, got {max_concurrency!r}")
    if ordering not in ORDERINGS:
        raise ConfigurationError(f"{where}: ordering must be one of {', '.join(ORDERINGS)}, got {ordering!r}")
