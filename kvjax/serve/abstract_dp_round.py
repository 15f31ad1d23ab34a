"""The MTP (EAGLE) speculative round under DP attention as abstract values: lower and compile
``kvjax.dp.speculative.make_dp_round_step`` (every DP rank's round in one program) over a
``("data", "tp")`` mesh of a TPU slice that is not here.

``abstract_dp_round_inputs(spec, config, mesh, batch, num_steps)`` gives the DP round's
arguments as ``jax.ShapeDtypeStruct`` leaves with the shardings it is jitted with, and the
``DPLayout`` it is made for:

* ``pools``: what ``build_dp_kv_cache`` builds for a ``NEXTN`` config: the target's ``kv`` and the
  MTP layer's ``kv_draft``, stacked per rank over ``"data"``
  (``kvjax.serve.abstract_dp_step.abstract_dp_pools``: traced, nothing allocated);
* ``store``: EAGLE's hidden-state store of every rank ``[dp, kv_draft slots, hidden]`` in the
  target's dtype, over ``"data"`` (as ``DPSpeculation.build`` allocates it);
* ``params`` / ``draft_params``: the target's and the MTP layer's parameter trees split over
  ``"tp"`` (replicated over ``"data"``): shapes only;
* ``first_tokens`` ``[dp, S]``, ``draft_metas`` ``[dp, k + 1, ...]`` and ``verify_meta``
  ``[dp, ...]``: every rank running the round of ``kvjax.serve.abstract_eagle_round.eagle_round_batch``
  on its own pages, stacked by ``kvjax.dp.speculative.stack_rank_rounds`` as the lockstep front
  stacks them, by rank (``host_sharding``).

:func:`lower_dp_round` lowers the DP round for them; ``.compile()`` gives one chip's program.
With ``chained`` it lowers the round overlap scheduling runs (``make_dp_round_step(...,
chained_page_size=...)``): every rank's round continued on the device from the previous DP
round's proposals ``[dp, S, k]`` and greedy tokens ``[dp, S, k + 1]`` (``src`` and ``room``
``[dp, S]`` beside them), laid out by rank as that round's outputs are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata
from kvjax.config import CacheConfig
from kvjax.dp.cache import DPLayout
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding
from kvjax.dp.speculative import make_dp_round_step, stack_rank_rounds
from kvjax.plan import plan_kv_cache
from kvjax.pools import CachePools
from kvjax.serve.abstract_dp_step import abstract_dp_pools, abstract_params, on_platform
from kvjax.serve.abstract_eagle_round import eagle_round_batch
from kvjax.serve.abstract_step import DecodeBatch
from kvjax.serve.model import as_model_config, param_shapes
from kvjax.serve.speculative.nextn import nextn_param_shapes
from kvjax.spec import ModelSpec

__all__ = ["AbstractDPRoundInputs", "abstract_dp_round_inputs", "lower_dp_round"]


@dataclasses.dataclass(frozen=True)
class AbstractDPRoundInputs:
    """The DP round's arguments as ``ShapeDtypeStruct`` trees with shardings, and the layout the
    round is made for (module docstring)."""

    layout: DPLayout
    pools: CachePools
    store: jax.ShapeDtypeStruct
    params: Any
    draft_params: Any
    first_tokens: jax.ShapeDtypeStruct
    draft_metas: AttentionMetadata
    verify_meta: AttentionMetadata
    page_size: int

    @property
    def num_steps(self) -> int:
        """``k``: the draft tokens per row."""
        return int(self.draft_metas.positions.shape[1]) - 1


def abstract_dp_round_inputs(
    spec: ModelSpec, config: CacheConfig, mesh: Mesh, batch: DecodeBatch, num_steps: int
) -> AbstractDPRoundInputs:
    """The DP round's arguments for every rank running one round of ``batch`` over ``mesh``
    (module docstring); ``config`` has ``enable_dp_attention`` and is planned for
    ``speculative_algorithm="NEXTN"``. Raises ``ValueError`` for a cache whose device pools are not
    ``kv`` and ``kv_draft`` or a batch one rank's pool cannot hold, and the build's own errors."""
    layout, pools = abstract_dp_pools(spec, config, mesh)
    if sorted(pools.names) != ["kv", "kv_draft"]:
        raise ValueError(
            f"{spec.name}'s DP cache has device pools {list(pools.names)}; the EAGLE round needs 'kv' and "
            "'kv_draft' (a full-attention or MLA target planned with speculative_algorithm='NEXTN')"
        )
    plan = plan_kv_cache(spec, on_platform(config, mesh))
    one = eagle_round_batch(batch, num_steps, plan.page_size, plan.max_total_tokens)
    first, draft_metas, verify = stack_rank_rounds([one] * layout.dp_size)
    by_rank = host_sharding(layout.mesh)

    def abstract(array: Any) -> jax.ShapeDtypeStruct:
        array = np.asarray(array)
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=by_rank)

    model = as_model_config(spec)
    slots = pools["kv_draft"].num_slots
    store = jax.ShapeDtypeStruct(
        (layout.dp_size, slots, model.hidden_size),
        jnp.dtype(model.dtype),
        sharding=NamedSharding(layout.mesh, P(DATA_MESH_AXIS)),
    )
    return AbstractDPRoundInputs(
        layout=layout,
        pools=pools,
        store=store,
        params=abstract_params(param_shapes(model), spec, layout.mesh),
        draft_params=abstract_params(nextn_param_shapes(model), spec, layout.mesh),
        first_tokens=abstract(first),
        draft_metas=jax.tree.map(abstract, draft_metas),
        verify_meta=jax.tree.map(abstract, verify),
        page_size=plan.alloc_page_size,
    )


def lower_dp_round(
    spec: ModelSpec, inputs: AbstractDPRoundInputs, *, with_logits: bool = False, chained: bool = False
) -> jax.stages.Lowered:
    """``make_dp_round_step(spec, inputs.layout)`` (the MTP layer drafting) lowered for
    ``inputs``: every rank's round as the lockstep DP front jits it, ready to ``.compile()``;
    ``chained``: the round overlap scheduling runs (module docstring)."""
    page_size = inputs.page_size if chained else None
    round_step = make_dp_round_step(spec, inputs.layout, with_logits=with_logits, chained_page_size=page_size)
    jitted: Any = round_step.jitted  # type: ignore[attr-defined]
    chain: tuple[jax.ShapeDtypeStruct, ...] = ()
    if chained:
        dp, rows = inputs.first_tokens.shape
        k, by_rank = inputs.num_steps, inputs.first_tokens.sharding
        chain = tuple(
            jax.ShapeDtypeStruct(shape, jnp.int32, sharding=by_rank)
            for shape in ((dp, rows, k), (dp, rows, k + 1), (dp, rows), (dp, rows))
        )
    return jitted.trace(
        inputs.pools,
        inputs.store,
        inputs.params,
        inputs.draft_params,
        inputs.first_tokens,
        inputs.draft_metas,
        inputs.verify_meta,
        *chain,
    ).lower()
