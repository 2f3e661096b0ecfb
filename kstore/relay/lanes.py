"""Which shard a record goes to, which lane publishes a shard, and how many lanes each relay takes.

Pure arithmetic on the shard count, which is fixed once the shards are made: every writer and
every relay of an outbox computes the same answers without asking each other.

Shards are published in lanes: an outbox of up to :data:`MAX_LANES` shards has a lane per shard;
one of more has :data:`MAX_LANES` lanes, lane ``n`` publishing the shards ``n``, ``n + MAX_LANES``,
... (:func:`lane_shards`). Many shards let many transactions commit records side by side (a
shard's row lock is held from its write to COMMIT); few lanes keep the relay's Kafka side small (a
lane is a lease, a transactional producer and a progress record). Relays of one group share the
lanes evenly (:func:`share`).
"""

from __future__ import annotations

import zlib

from kstore.types import Produced

#: Lanes of an outbox of more shards than this (see the module's docstring). Fixed: a lane's shards
#: follow from the shard count alone, which is fixed once made, so every relay agrees on them.
MAX_LANES = 8


def shard_of(record: Produced, shards: int) -> int:
    """The shard a record goes to: by key, so that one key's records keep their commit order;
    a record without a key by its topic (keyless records of one topic keep theirs)."""
    basis = record.key if record.key is not None else record.topic.encode()
    return zlib.crc32(basis) % shards


def lanes_of(shards: int) -> int:
    """How many lanes an outbox of ``shards`` shards is published in."""
    return min(shards, MAX_LANES)


def lane_shards(lane: int, shards: int) -> tuple[int, ...]:
    """The shards lane ``lane`` publishes, of an outbox of ``shards``."""
    return tuple(range(lane, shards, lanes_of(shards)))


def share(shards: int, counts: dict[str, int], me: str) -> int:
    """How many lanes relay ``me`` should take (> 0) or give up (-1), or 0, given how many each
    live relay holds (``counts``, ``me`` included), of ``shards`` lanes. Each ends with
    ``shards // relays`` or one more.

    One that holds less than its floor takes free lanes first: a relay with its floor only takes
    one more while nobody is below theirs, and a relay above the floor gives one up while someone
    is below it (so three relays on four shards end 2-1-1, not 2-2-0).
    """
    low, high = shards // len(counts), -(-shards // len(counts))
    mine, least = counts[me], min(counts.values())
    if mine > high or (mine > low and least < low and mine > least + 1):
        return -1
    if mine < low:
        return low - mine
    if mine < high and least >= low:
        return high - mine
    return 0
