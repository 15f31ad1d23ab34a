"""`make_dp_step`: one jitted serving step for every DP rank at once, over the stacked DP pools.

Every rank's batch (``stack_rank_inputs``: tokens ``[dp, T]``, metadata leaves ``[dp, ...]``)
goes through the model in one program over the ``("data", "tp")`` mesh:

* ``jax.shard_map`` makes ``"data"`` manual (``axis_names={"data"}``) and leaves ``"tp"``
  automatic: inside, each DP rank sees its own tokens, metadata and slice of the pools, viewed
  as one rank's pools (``DPLayout.rank_pools``: the rank's KV heads over its ``attn_tp_size``
  devices), and runs the family's forward on them, then greedy sampling.
* Under decode context parallelism (a ``("data", "tp", "dcp")`` mesh) "tp" and "dcp" stay
  automatic: each rank's weights split over both jointly and its pools striped over "dcp", as
  the single-rank DCP step over the rank's ``("tp", "dcp")`` group (the pools' DCP attention,
  ``kvjax.attention.dcp_striped_layer``, nests its ``shard_map`` in the rank's).
* Within a rank the forward is tensor parallel exactly as the single-rank sharded step
  (``kvjax.serve.step.make_sharded_step``): weights split Megatron style over ``"tp"``
  (``kvjax.serve.param_sharding``, replicated over ``"data"``), the attention kernels per device
  on their KV heads (a ``shard_map`` over ``"tp"`` nested in the rank's), and GSPMD inserts one
  all-reduce of ``[tokens, hidden]`` over the rank's ``"tp"`` group after attention and one after
  the MLP per layer. Nothing crosses ``"data"``: ranks never exchange data.
* Jitted with explicit in/out shardings (pools as laid out, weights as ``param_sharding``
  splits them, tokens, metadata and outputs over ``"data"``) and the pools donated (every KV
  write in place on its device). When the mesh spans several processes (``kvjax.multihost``)
  every process runs every rank's scheduler, so it passes every rank's inputs and reads every
  rank's outputs: tokens, metadata and outputs are then replicated (``host_sharding``; the
  inputs as ``make_sharded_step`` takes them, each rank's ``shard_map`` reading its own row
  with no data moved), at the cost of one all-gather over ``"data"`` of the sampled tokens (and
  logits) per step.

Future tokens (overlap scheduling, ``LockstepDPScheduler``): ``step(pools, params, tokens, meta,
prev_tokens, token_src)`` takes input ids that the previous DP step sampled and the host has not
read yet, as ``kvjax.serve.step`` does for one rank: ``prev_tokens`` is that step's stacked
``next_tokens`` (``[dp, S]``, on the device), ``token_src`` int32 ``[dp, T]``: where
``token_src[r, i] >= 0`` the input id of rank ``r``'s token ``i`` is
``prev_tokens[r, token_src[r, i]]`` (a row of the rank's own slice: nothing crosses ``"data"``),
else ``tokens[r, i]``.

A rank's tokens, logits and pools are those of the single-rank step on its inputs alone (one
device per rank: bit for bit; ``attn_tp_size`` devices: those of ``make_sharded_step`` over the
rank's ``("tp",)`` mesh).

The MLP: SGLang's DP attention gathers every rank's tokens and runs the MLP/MoE tensor parallel
over all ``tp_size`` chips. kvjax runs it per rank, over the rank's ``attn_tp_size`` chips, on
the rank's own tokens: the same result per token (the MLP is per token), no gather or scatter
between attention and MLP, but each device holds ``1 / attn_tp_size`` of the MLP weights instead
of ``1 / tp_size``: ``dp_size`` times SGLang's MLP weight memory per device. That is the cost of
this first step; for a dense model whose weights fit it trades memory for two fewer collectives
per layer (the all-gather of the ranks' tokens and the scatter back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention.metadata import AttentionMetadata
from kvjax.dp.layout import DPLayout
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding
from kvjax.pools.cache_pools import CachePools
from kvjax.serve.causal_lm import PipelineStage, StackNames, stage_params
from kvjax.serve.model import as_model_config, build_model, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings, shard_params
from kvjax.serve.step import positional_step, step_body
from kvjax.spec import ModelSpec

__all__ = ["host_sharding", "make_dp_step", "place_params", "rank_view"]


def place_params(
    model: ModelSpec | ModelConfig, params: Any, layout: DPLayout, stage: PipelineStage | None = None
) -> Any:
    """The model's weights on the DP mesh as the DP step takes them: split Megatron style over
    ``"tp"`` (``kvjax.serve.param_sharding``, re-laid out as its rules say), replicated over
    ``"data"``; with ``stage``, the stage's weights only (``stage_params``)."""
    config = as_model_config(model)
    if stage is not None:
        params = stage_params(params, stage, _stack_names(config), config.tie_word_embeddings)
    return shard_params(params, config, layout.mesh)


def make_dp_step(
    model: ModelSpec | ModelConfig, layout: DPLayout, *, with_logits: bool = False, stage: PipelineStage | None = None
) -> Callable[..., Any]:
    """``step(pools, params, tokens [dp, T], meta[, prev_tokens [dp, S], token_src [dp, T]]) ->
    (pools, next_tokens [dp, S])`` (with ``with_logits``: also ``logits [dp, S, vocab]``
    float32; the future tokens as the module docstring says), jitted over ``layout.mesh`` with
    explicit shardings and the pools donated (module docstring). ``params`` as ``place_params``
    lays them out. ``step.jitted`` is the jitted function (for ``.lower(...)``).

    ``stage``: every rank's step over one pipeline stage's layers (``kvjax.dp.pipeline``), its
    pools and weights (``stage_params``) those of the stage: the first takes the tokens (and the
    future tokens), a later one the hidden states ``[dp, T, hidden]`` of the stage before it in
    place of ``tokens``; a stage before the last returns ``(pools, hidden [dp, T, hidden])``."""
    config = as_model_config(model)
    module = build_model(config) if stage is None else build_model(config).clone(stage=stage)
    sample = stage is None or stage.last
    mesh = layout.mesh
    rows = P(DATA_MESH_AXIS)
    rank_def = layout.rank_pools

    def per_rank(
        pools: CachePools, params: Any, tokens: jax.Array, meta: AttentionMetadata, *future: jax.Array
    ) -> tuple[CachePools, jax.Array, jax.Array]:
        leaves, stacked_def = jax.tree_util.tree_flatten(pools)
        mine = rank_view(leaves, rank_def)
        tokens, meta = jax.tree.map(lambda x: x[0], (tokens, meta))
        prev, src = (future[0][0], future[1][0]) if future else (None, None)  # overlap: this rank's rows
        if sample:
            new_pools, next_tokens, logits = step_body(module, mine, params, tokens, meta, prev, src, with_logits=True)
        else:  # a stage before the last: its hidden states (twice, for the one output structure)
            new_pools, next_tokens = step_body(module, mine, params, tokens, meta, prev, src, sample=False)
            logits = next_tokens
        new_leaves = [x[None] for x in jax.tree_util.tree_leaves(new_pools)]
        return jax.tree_util.tree_unflatten(stacked_def, new_leaves), next_tokens[None], logits[None]

    def step(
        pools: CachePools,
        params: Any,
        tokens: jax.Array,
        meta: AttentionMetadata,
        prev_tokens: jax.Array | None = None,
        token_src: jax.Array | None = None,
    ) -> tuple[Any, ...]:
        meta_specs = jax.tree.map(lambda _: rows, meta)
        future = () if prev_tokens is None or token_src is None else (prev_tokens, token_src)
        run = jax.shard_map(
            per_rank,
            mesh=mesh,
            # "tp" stays automatic: the pools keep their head split
            in_specs=(rows, P(), rows, meta_specs, *(rows for _ in future)),
            out_specs=(rows, rows, rows),
            axis_names={DATA_MESH_AXIS},
            check_vma=False,
        )
        new_pools, next_tokens, logits = run(pools, params, tokens, meta, *future)
        return (new_pools, next_tokens, logits) if with_logits and sample else (new_pools, next_tokens)

    pool_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.pool_specs, is_leaf=_is_spec)
    weights = _param_shardings(config, layout, stage)
    by_rank = host_sharding(mesh)
    outs = (pool_shardings, by_rank, by_rank) if with_logits and sample else (pool_shardings, by_rank)
    # tokens, meta (a prefix: every leaf), prev_tokens, token_src by rank (replicated over several
    # processes); prev_tokens is laid out as the step's own next_tokens, so it moves no data.
    jitted = jax.jit(
        step,
        in_shardings=(pool_shardings, weights, by_rank, by_rank, by_rank, by_rank),
        out_shardings=outs,
        donate_argnums=0,
    )

    return positional_step(jitted)


def _param_shardings(config: ModelConfig, layout: DPLayout, stage: PipelineStage | None = None) -> Any:
    """The weights' ``NamedSharding`` tree over ``layout.mesh`` (``param_sharding``'s rules over
    ``"tp"``, or ``("tp", "dcp")`` jointly under decode context parallelism; as ``place_params``
    lays them out), from the model's parameter shapes (no weights needed); with ``stage``, of the
    stage's weights only (``stage_params``)."""
    shapes = param_shapes(config)
    if stage is not None:
        shapes = stage_params(shapes, stage, _stack_names(config), config.tie_word_embeddings)
    return param_shardings(shapes, config, layout.mesh)


def _stack_names(config: ModelConfig) -> StackNames:
    names = build_model(config).names
    assert isinstance(names, StackNames)
    return names


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def rank_view(leaves: list[jax.Array], rank_def: Any) -> Any:
    """Inside a ``shard_map`` whose ``"data"`` axis is manual: the rank's pools (of structure
    ``rank_def``, ``DPLayout.rank_pools`` or a part of it) from the stacked pools' ``leaves``
    (each ``[1, ...]`` there), running over the context mesh (``_on_mesh``)."""
    return _on_mesh(jax.tree_util.tree_unflatten(rank_def, [x[0] for x in leaves]), jax.sharding.get_abstract_mesh())


def _has_mesh(node: Any) -> bool:
    return dataclasses.is_dataclass(node) and getattr(node, "mesh", None) is not None


def _on_mesh(pools: Any, mesh: Any) -> Any:
    """``pools`` with every pool that runs per device over a mesh (a ``mesh`` static field) set
    to run over ``mesh``: inside the rank's ``shard_map`` the context mesh, whose ``"data"`` axis
    is already manual, so the pools' own ``shard_map`` over ``"tp"`` nests in the rank's."""
    return jax.tree.map(
        lambda node: dataclasses.replace(node, mesh=mesh) if _has_mesh(node) else node, pools, is_leaf=_has_mesh
    )
