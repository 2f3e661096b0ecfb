"""Topics' partition counts on kafka-python, for the worker's check of what a processor produces.

The worker reaches :class:`kstore.kafka.seam.PartitionCounts` through
:func:`kstore.kafka.clients.partition_counts` once its consumer side does; until then it imports this.
"""

from __future__ import annotations

from kstore.kafka import seam
from kstore.settings import Settings

from .admin import KafkaPythonAdmin


class PartitionCounts(seam.PartitionCounts):
    """:class:`kstore.kafka.seam.PartitionCounts` asked through kafka-python."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, lambda: KafkaPythonAdmin(settings, patience_s=0))
