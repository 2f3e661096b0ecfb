"""A processor for dead letters of any size and content: it keeps what each message's value was (its
length and SHA-256), one row a message in ``large_effects``, so a test sees the exact bytes it got.

Imported as ``large_letter_processors`` by ``kstore console``, and as
``tests.support.large_letter_processors`` in a test."""

from __future__ import annotations

import hashlib

import sqlalchemy as sa

from kstore import Message, Processor

metadata = sa.MetaData()
large_effects = sa.Table(
    "large_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kafka_offset", sa.BigInteger, nullable=False),
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
)


def digest(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


class Measured(Processor):
    group = "large-letters"

    def setup(self) -> None:
        metadata.create_all(self.engine)

    def handle(self, msg: Message) -> None:
        value = msg.value or b""
        self.session.execute(sa.insert(large_effects).values(kafka_offset=msg.offset, size=len(value),
                                                             sha256=digest(value)))
