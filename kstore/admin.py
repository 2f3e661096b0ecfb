"""Old home of the offset administration, kept because the docs told users to import it from here:
it lives in :mod:`kstore.ops.offsets` (``kstore offsets show|set|history`` from Python).

Only re-exports. Nothing in kstore imports this module; a test that patches what the offset
administration looks up (its ``make_engine``) patches :mod:`kstore.ops.offsets`.
"""

from __future__ import annotations

from kstore.ops.offsets import PartitionStatus, PlannedReset, ResetRequest, offset_history, set_offsets, show_offsets

__all__ = ["PartitionStatus", "PlannedReset", "ResetRequest", "offset_history", "set_offsets", "show_offsets"]
