"""The ``cpu_tensor`` decode retraction backup's planning: a plan uses it when it resolves
``decode_retraction_backup == "cpu_tensor"`` and the backup is active (with a draft model too: its
pool ``"kv_draft"`` is copied and restored at the same slots as the target's). It plans no pool
(the copies live in host memory the serving loop holds); it attaches only where every kind of the
cache allows page copies (``PlannerKind.page_backup``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.names import RETRACTION
from kvjax.plan.kinds.planner_kind import PlannerKind

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan


def uses(plan: CachePlan) -> bool:
    return plan.decode_retraction_backup == "cpu_tensor" and bool(plan.decode_retraction_active)


# No state of its own per slot: freeing a rejected draft token's slot rolls it back (a backup
# copies a request's live slots only, taken at retraction, after the round's rollback).
KIND = PlannerKind(name=RETRACTION, uses=uses, speculative_rollback=True)
