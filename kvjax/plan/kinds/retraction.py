"""The ``cpu_tensor`` decode retraction backup's planning: a plan uses it when it resolves
``decode_retraction_backup == "cpu_tensor"``, the backup is active and there is no draft model (its
pool is not copied: a speculative server recomputes retracted requests). It plans no pool (the
copies live in host memory the serving loop holds); it attaches only where every kind of the
cache allows page copies (``PlannerKind.page_backup``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.names import RETRACTION
from kvjax.plan.kinds.planner_kind import PlannerKind

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan


def uses(plan: CachePlan) -> bool:
    # A draft model's pool is not copied (the copies are the target's "kv" pages): a speculative
    # server recomputes its retracted requests (the host_pool backup copies both pools).
    return plan.decode_retraction_backup == "cpu_tensor" and bool(plan.decode_retraction_active) and plan.draft is None


KIND = PlannerKind(name=RETRACTION, uses=uses)
