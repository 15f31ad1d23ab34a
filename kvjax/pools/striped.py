"""``StripedOverContext``: the refusal shared by pools that may be striped over decode-context-parallel ranks."""

from __future__ import annotations

from typing import ClassVar

__all__ = ["StripedOverContext"]


class StripedOverContext:
    """Mixin for a pool that may be striped over decode-context-parallel (DCP) ranks
    (``context_axis`` set): its slots are then not rows of the global array (``kvjax.alloc.dcp``),
    and only the DCP attention module named by ``DCP_ATTENTION`` writes and reads it."""

    DCP_ATTENTION: ClassVar[str]
    context_axis: str | None

    def _require_unstriped(self, what: str) -> None:
        """``NotImplementedError`` naming ``what`` on a pool striped over DCP ranks."""
        if self.context_axis is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.{what} on a pool striped over the {self.context_axis!r} mesh axis (decode "
                f"context parallelism) is not built; {self.DCP_ATTENTION} writes and reads it"
            )
