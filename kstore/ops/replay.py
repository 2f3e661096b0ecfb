"""Replaying dead letters through a processor: ``kstore dead-letters replay``, from code or the CLI.

A replay runs the processor on the letter's message (its key or value edited if asked) inside
the transaction that marks the letter replayed (:meth:`kstore.db.deadletters.DeadLetters.replay`),
so its effects and the mark commit together, once, even if two operators replay it at once.
The processor's ``setup`` and ``teardown`` run around a replay as around a worker's life.
No worker is needed, and none is involved: this runs in the operator's process.

Replays through one :class:`Processor` object run one at a time (the console's operators, or a
program's threads, sharing it): a processor is written for a worker, which runs one batch at a time
between one ``setup`` and one ``teardown``. A second waits for the first (:data:`BUSY_WAIT_S`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Connection

from kstore.db.deadletters import (
    DEAD,
    REPLAYED,
    DeadLetter,
    DeadLetterBusyError,
    DeadLetters,
    DeadLetterStateError,
    Edit,
)
from kstore.db.letterquery import BATCH, LetterFilter, Tally, finish, start, waiting, walk
from kstore.db.sqlerrors import error_text, first_line, transient
from kstore.errors import CommitInDoubtError, ConfigurationError, DatabaseError, KstoreError
from kstore.kafka.clients import partition_counts
from kstore.processor import Processor
from kstore.relay.store import Outbox
from kstore.running.handler import NOT_THE_MESSAGE, Outgoing, produce_check, run_handler
from kstore.running.hooks import call_hook, call_setup, declared_topics, deserialized, to_ms
from kstore.schemas.formats import bind as bind_formats
from kstore.schemas.formats import encode_like, formats_of
from kstore.settings import Settings
from kstore.types import Produced


def replay(letters: DeadLetters, processor: Processor, letter: DeadLetter, edit: Edit | None = None,
           reason: str | None = None, check: Callable[[Produced], None] | None = None) -> bool:
    """Run one dead letter (``edit`` replacing its key or value) through ``processor``, exactly once.

    True if its effects and its 'replayed' mark committed; False if it was already replayed.
    What the processor produces goes to the group's outbox in the same transaction (``check``
    refuses a record that could never be published). Raises what the processor raises (nothing
    is committed then); see :meth:`~kstore.db.deadletters.DeadLetters.replay` for the rest.
    """
    raw = edit.apply(letter) if edit else (letter.key, letter.value)
    if edit:  # an edit of a registry format is given decoded: written with the schema of the original
        formats = formats_of(processor)
        raw = (raw[0] if edit.key is None else encode_like(formats, letter.key, edit.key, True),
               raw[1] if edit.value is None else encode_like(formats, letter.value, edit.value, False))
    msg = deserialized(processor, letter.topic, letter.partition_id, letter.offset, *raw, letter.headers,
                       to_ms(letter.timestamp))
    settings = letters.settings

    def run(conn: Connection) -> None:
        outgoing = Outgoing(check)
        run_handler(processor, conn, [msg], outgoing=outgoing)
        if outgoing.records:
            outbox = Outbox(letters.engine, letter.consumer_group, settings.table_prefix, settings.schema)
            outbox.ensure_shards(settings.outbox_shards)
            outbox.write(conn, outgoing.records)

    return letters.replay(letter, run, edited=raw if edit else None, reason=reason)


@dataclass(frozen=True)
class ReplayResult:
    replayed: list[int]
    skipped: list[int]
    failed: dict[int, str]


def replay_dead_letters(settings: Settings, processor: Processor, group: str, ids: Sequence[int],
                        edits: Mapping[int, Edit] | None = None, reason: str | None = None) -> ReplayResult:
    """Replay the given dead letters of a group through ``processor``, each exactly once.

    ``edits`` maps ids (which must be among ``ids``) to a replacement key or value. Letters of
    another group, or already replayed, are skipped; a discarded or resolved one among ``ids``
    raises :class:`DeadLetterStateError` before anything runs. ``reason`` goes to the history.
    For every letter a filter matches, however many, see :func:`replay_matching`.
    """
    if not ids:
        raise ConfigurationError("give the dead letters to replay (--id N, repeatable)")
    edits = dict(edits or {})
    stray = sorted(set(edits) - set(ids))
    if stray:
        raise ConfigurationError(f"an edit for dead letter(s) {', '.join(map(str, stray))} needs their --id")
    with DeadLetters(settings) as letters:
        todo = [letters.get(i) for i in ids]
        closed = [d for d in todo if d.consumer_group == group and d.status not in (DEAD, REPLAYED)]
        if closed:
            with letters.engine.connect() as conn:
                why = "; ".join(letters.state_note(conn, d.id, d.status) for d in closed)
            raise DeadLetterStateError(f"cannot replay {why}; nothing was replayed")
        result = ReplayResult([], [], {})
        with _replaying(letters, processor, group) as check:
            for letter in todo:
                if letter.consumer_group != group or letter.status != DEAD:
                    result.skipped.append(letter.id)
                    continue
                _replay_one(letters, processor, letter, edits.get(letter.id), reason, result, check)
        return result


def replay_matching(settings: Settings, processor: Processor, group: str, where: LetterFilter | None = None,
                    reason: str | None = None, size: int = BATCH) -> Tally:
    """Replay every waiting letter of a group that ``where`` matches (default: all) through ``processor``.

    It walks them by id, up to the highest there at its start, reading ``size`` at a time; each
    replay is one transaction, exactly once, as :func:`replay_dead_letters` runs it. A letter that
    fails again takes the failure, stays dead and is counted; the walk goes on past it, so letters
    that keep failing never hold up the ones after them. A letter another operator is replaying
    (or changed since it was read) is skipped. A replay whose COMMIT is in doubt stops the walk
    (what landed before it stays; its message says how much). ``Tally.remaining`` counts the
    matching letters dead-lettered after the walk started.
    """
    where = waiting(where)
    tally = Tally("replay")
    with DeadLetters(settings) as letters:
        found = start(letters, group, where)
        if found.last_id is None:
            return tally
        tally.first_id = found.first_id
        with _replaying(letters, processor, group) as check:
            try:
                for letters_page in walk(letters, group, where, found.last_id, size):
                    for letter in letters_page:
                        _replay_counted(letters, processor, letter, reason, tally, check)
            except KstoreError as exc:
                raise tally.so_far(exc) from None
        tally.last_id = found.last_id
        return finish(letters, group, where, tally)


@contextmanager
def _replaying(letters: DeadLetters, processor: Processor, group: str) -> Iterator[Callable[[Produced], None]]:
    """The processor's ``setup`` (under the group's setup lock, as a worker's) and ``teardown``
    around replays, and the check of what they produce; all of it one replay at a time per
    processor object (:func:`_one_at_a_time`)."""
    settings = letters.settings
    with _one_at_a_time(processor, group):
        bind_formats(processor, settings)
        call_setup(processor, letters.engine, group)
        partitions = partition_counts(settings)
        try:
            yield produce_check(partitions.count, settings.outbox_max_record_bytes,
                                f"Kafka at {settings.bootstrap_servers}", declared_topics(processor))
        finally:
            partitions.close()
        call_hook(processor, "teardown")


#: How long a replay waits for another one through the same processor object: an operator's page
#: or command behind a long walk is told to try again rather than left hanging.
BUSY_WAIT_S = 60.0


@dataclass
class _Turn:
    """A processor object's replays: the lock one holds, and how many hold it or wait for it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


#: By ``id(processor)`` (a processor need not be hashable); an entry lives only while a replay holds
#: or waits for it, so its processor is alive and no other object has that id.
_turns: dict[int, _Turn] = {}
_turns_lock = threading.Lock()


@contextmanager
def _one_at_a_time(processor: Processor, group: str) -> Iterator[None]:
    """Hold ``processor`` for one replay, after waiting up to :data:`BUSY_WAIT_S` for the one
    holding it; :class:`DeadLetterBusyError` if it is still held then (nothing ran)."""
    key = id(processor)
    with _turns_lock:
        turn = _turns.setdefault(key, _Turn())
        turn.users += 1
    try:
        if not turn.lock.acquire(timeout=BUSY_WAIT_S):
            raise DeadLetterBusyError(
                f"another replay through the processor of group {group!r} ({type(processor).__name__}) is "
                f"running: try again when it has finished; nothing was replayed")
        try:
            yield
        finally:
            turn.lock.release()
    finally:
        with _turns_lock:
            turn.users -= 1
            if not turn.users:
                del _turns[key]


#: How often a walk tries one letter through database errors before it stops, and the first pause.
OUTAGE_TRIES = 3
OUTAGE_PAUSE_S = 0.5


def _replay_through_outages(letters: DeadLetters, processor: Processor, letter: DeadLetter,
                            reason: str | None, check: Callable[[Produced], None]) -> bool:
    """One letter's replay, tried again after a lost connection (a restart or failover is not the
    letter's fault); a database that stays away stops the walk with the letter as it was."""
    for attempt in range(1, OUTAGE_TRIES + 1):
        try:
            return replay(letters, processor, letter, None, reason, check)
        except Exception as exc:
            if not transient(exc):
                raise
            if attempt == OUTAGE_TRIES:
                raise DatabaseError(f"the database failed while replaying dead letter {letter.id} "
                                    f"({OUTAGE_TRIES} tries): {first_line(exc)}") from None
            time.sleep(OUTAGE_PAUSE_S * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def _replay_counted(letters: DeadLetters, processor: Processor, letter: DeadLetter, reason: str | None,
                    tally: Tally, check: Callable[[Produced], None]) -> None:
    try:
        replayed = _replay_through_outages(letters, processor, letter, reason, check)
    except DeadLetterStateError:  # busy (another operator replays it) or closed since it was read: theirs
        tally.skipped += 1
        return
    except CommitInDoubtError:
        raise  # it may have landed: the operator must look before anything else
    except (DatabaseError, *NOT_THE_MESSAGE):
        raise  # not the letter's fault (an outage, a missing topic, the processor's contract): stop the walk
    except Exception as exc:
        # The letter takes the failure and stays dead; the walk goes on past it.
        letters.note_failure(letter, exc, reason)
        tally.fail(letter.id, error_text(exc, letters.settings.log_statement_parameters))
        return
    if replayed:
        tally.done += 1
    else:
        tally.skipped += 1


def _replay_one(letters: DeadLetters, processor: Processor, letter: DeadLetter, edit: Edit | None,
                reason: str | None, result: ReplayResult, check: Callable[[Produced], None]) -> None:
    try:
        replayed = replay(letters, processor, letter, edit, reason, check)
        (result.replayed if replayed else result.skipped).append(letter.id)
    except DeadLetterBusyError as exc:
        done = ", ".join(map(str, result.replayed))
        raise DeadLetterBusyError(f"{exc}; replayed before it by this command: {done}" if done else str(exc)) from None
    except (CommitInDoubtError, DeadLetterStateError, ConfigurationError, *NOT_THE_MESSAGE):
        # Not a failure to count: it may have landed, was closed meanwhile, the edit cannot be written as
        # given (the operator's to fix), or it is not the letter's fault.
        raise
    except Exception as exc:
        # The letter takes the failure (no second letter for the message), unless it left dead meanwhile.
        letters.note_failure(letter, exc, reason, edited=edit.apply(letter) if edit else None)
        result.failed[letter.id] = error_text(exc, letters.settings.log_statement_parameters)


def edits_from_options(ids: Sequence[int], key: str | None, value: str | None,
                       value_file: str | None) -> dict[int, Edit]:
    """``kstore dead-letters replay --key/--value/--value-file``: one edit, for exactly one ``--id``."""
    if key is None and value is None and value_file is None:
        return {}
    if value is not None and value_file is not None:
        raise ConfigurationError("give --value or --value-file, not both")
    if len(ids) != 1:
        raise ConfigurationError("an edited replay (--key, --value, --value-file) needs exactly one --id")
    try:
        new_value = Path(value_file).read_bytes() if value_file is not None else None
    except OSError as exc:
        raise ConfigurationError(f"cannot read --value-file {value_file}: {exc.strerror}") from None
    if value is not None:
        new_value = value.encode()
    return {ids[0]: Edit(key=None if key is None else key.encode(), value=new_value)}
