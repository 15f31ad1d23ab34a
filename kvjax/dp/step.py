"""`make_dp_step`: one jitted serving step for every DP rank at once, over the stacked DP pools.

Every rank's batch (``stack_rank_inputs``: tokens ``[dp, T]``, metadata leaves ``[dp, ...]``)
goes through the model in one program: inside ``jax.shard_map`` over ``"data"`` each rank runs
the family's forward on its own tokens, its own metadata and its own slice of the pools, then
greedy sampling. The pools are donated (every KV write in place). A rank's tokens, logits and
pools are those of the single-rank step (``kvjax.serve.step.make_step``) on its inputs alone.

Scope: one device per rank (``attn_tp_size == 1``). The weights are replicated over the mesh
(``replicate_params``), so the MLP runs per rank on that rank's tokens: token for token the
same arithmetic as SGLang's DP attention, where the tokens of all ranks are gathered and the MLP
runs tensor-parallel over all chips (a layout that saves weight memory, not one that changes a
token's result). Ranks of several devices need the family's forward sharded over ``"tp"``
inside the rank (tensor-parallel serving).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention.metadata import AttentionMetadata
from kvjax.dp.attention import laid_out
from kvjax.dp.cache import DATA_MESH_AXIS, DPLayout
from kvjax.pools.cache_pools import CachePools
from kvjax.serve.model import as_model_config, build_model
from kvjax.serve.model_config import ModelConfig
from kvjax.spec import ModelSpec

__all__ = ["make_dp_step", "replicate_params"]


def replicate_params(params: Any, layout: DPLayout) -> Any:
    """The model's weights copied to every device of the DP mesh (the step's ``params``)."""
    return jax.device_put(params, NamedSharding(layout.mesh, P()))


def make_dp_step(model: ModelSpec | ModelConfig, layout: DPLayout, *, with_logits: bool = False) -> Callable[..., Any]:
    """``step(pools, params, tokens [dp, T], meta) -> (pools, next_tokens [dp, S])`` (with
    ``with_logits``: also ``logits [dp, S, vocab]`` float32), jitted with the pools donated.

    Raises:
        NotImplementedError: ranks of more than one device (module docstring).
    """
    if layout.attn_tp_size != 1:
        raise NotImplementedError(
            f"a DP step over ranks of {layout.attn_tp_size} devices needs the model's forward sharded over "
            "'tp' inside each rank (tensor-parallel serving); use one device per rank (tp_size == dp_size)"
        )
    module = build_model(as_model_config(model))
    rows = P(DATA_MESH_AXIS)

    def per_rank(
        pools: CachePools, params: Any, tokens: jax.Array, meta: AttentionMetadata
    ) -> tuple[CachePools, jax.Array, jax.Array]:
        pools, tokens, meta = jax.tree.map(lambda x: x[0], (pools, tokens, meta))
        logits, new_pools = module.apply({"params": params}, tokens, pools, meta)
        next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.tree.map(lambda x: x[None], new_pools), next_tokens[None], logits[None]

    def step(pools: CachePools, params: Any, tokens: jax.Array, meta: AttentionMetadata) -> tuple[Any, ...]:
        meta_specs = jax.tree.map(lambda _: rows, meta)
        run = jax.shard_map(
            per_rank,
            mesh=layout.mesh,
            in_specs=(layout.pool_specs, P(), rows, meta_specs),
            out_specs=(layout.pool_specs, rows, rows),
            check_vma=False,
        )
        tokens = laid_out(tokens, layout, rows)
        meta = jax.tree.map(lambda x: laid_out(x, layout, rows), meta)
        new_pools, next_tokens, logits = run(pools, params, tokens, meta)
        return (new_pools, next_tokens, logits) if with_logits else (new_pools, next_tokens)

    return jax.jit(step, donate_argnums=0)
