"""Megatron-style tensor parallelism of a served model's weights: a rule table by parameter path.

Weights keep Hugging Face's layout (a linear layer's ``weight`` is ``[out, in]``, ``kvjax.serve.layers``).
Over a mesh's tensor-parallel axis (``"tp"``, the axis the pools' KV heads are sharded over):

===========================================================  ==========================  ===============
parameter (path ends with)                                   layout                      split unit
===========================================================  ==========================  ===============
``self_attn/{q_proj, q_b_proj}``                             column: ``P(tp, None)``     query heads
``self_attn/{k_proj, v_proj}``                               column                      KV heads
``self_attn/kv_b_proj`` (MLA, per-head up-projections)       column                      query heads
``self_attn/o_proj``                                         row: ``P(None, tp)``        query heads
``mlp/{gate_proj, up_proj}``, ``shared_experts/{...}``       column                      intermediate
``mlp/down_proj``, ``shared_experts/down_proj``              row                         intermediate
(Qwen3-Next's single ``shared_expert``: the same rules)
``experts_{e}/{gate_proj, up_proj}`` (routed experts)        column                      MoE intermediate
``experts_{e}/down_proj`` (routed experts)                   row                         MoE intermediate
(Nemotron-H names its blocks' attention and MLP ``mixer``: the same rules)
``linear_attn/{in_proj_qkvz, in_proj_ba}`` (gated delta net) column                      key heads
``linear_attn/conv1d`` (re-laid out at load, below)          column (channels)           key heads
``linear_attn/{A_log, dt_bias}``                             column                      key heads
``linear_attn/out_proj``                                     row                         key heads
``mixer/{in_proj, conv1d}`` (Mamba2, re-laid out at load)    column                      B/C groups
``mixer/{A_log, dt_bias, D, norm}`` (Mamba2)                 column                      B/C groups
``mixer/out_proj`` (Mamba2)                                  row                         B/C groups
everything else (embeddings, norms, LM head, MLA's latent    replicated: ``P()``
``kv_a_proj_with_mqa`` and ``q_a_proj``, MoE routers and
``shared_expert_gate``, gpt-oss's fused experts, the gated
delta net's ``norm`` (one ``[v_head_dim]`` weight shared by
the heads))
===========================================================  ==========================  ===============

A column-parallel bias is split with its rows; a row-parallel bias is replicated (added once, after
the sum). A rule applies only when its unit splits evenly over the ranks; otherwise the weight is
replicated (KV heads fewer than the ranks: every rank computes all KV heads and keeps the one its
pool shard holds, ``kvjax.attention.sharding.expand_kv_heads``, as SGLang's replicated KV heads).

Collectives: the step runs under ``jax.jit`` over a mesh with ``Auto`` axes, so XLA (GSPMD)
partitions it from these layouts: the hidden state is replicated, the column-parallel projections
produce head-sharded q/k/v that enter the per-device attention kernels (``shard_map``) without
moving, and the row-parallel ``o_proj`` and ``down_proj`` end in partial sums: one all-reduce of
``[tokens, hidden]`` after attention and one after the MLP per layer, Megatron's minimum. Any
layout gives the same numbers (XLA keeps the program's meaning whatever the shardings); the table
only decides where data moves.

Routed experts (``kvjax.serve.moe.SparseMoE``: DeepSeek-V2/V3, Qwen2-MoE, Qwen3-Next) are split as
SGLang's ``FusedMoE`` splits them without expert parallelism: every rank holds every expert, and a
``1 / tp`` slice of each expert's ``moe_intermediate_size`` (its rows of ``gate_proj``/``up_proj``,
its columns of ``down_proj``), so a rank holds ``1 / tp`` of the experts' bytes (DeepSeek-V3: 21 GiB
per MoE layer replicated, 1.3 GiB per chip at tp 16). The block folds its routing weights into the
hidden activations before the down projection (``kvjax.serve.moe``, order of operations), so the
experts' and the shared experts' down projections end in one ``[tokens, hidden]`` partial sum: one
all-reduce after the MoE block, as after a dense MLP. They split only when ``moe_intermediate_size``
divides over the ranks (else replicated). gpt-oss's fused, biased experts
(``kvjax.serve.families.gpt_oss``) are not split.

MLA (DeepSeek-V2/V3): the latent ``c_kv``/``k_pe`` is one shared row per token, not per head, so
its projection (``kv_a_proj_with_mqa``) is replicated and every rank writes the same rows into its
replica of the latent pool (``kvjax.pools.mla``: replicated over TP, as sglang-jax does). Splitting
the latent would need an all-gather before every attention (each head reads all of it); replicating
costs ``tp`` times its memory instead, which DP attention avoids by giving each rank its own requests.
The query heads and the per-head ``kv_b_proj`` are split, so attention itself is head-parallel.

Qwen3-Next's gated delta net (``linear_attn``) is head-parallel, as SGLang runs it: Transformers
lays ``in_proj_qkvz`` out per key head (``[q, k, v, z]`` of key head 0 and its
``num_v_heads / num_k_heads`` value heads, then key head 1, ...) and ``in_proj_ba`` likewise
(``[b, a]`` per key head), so a contiguous split of their rows gives each rank whole key heads with
their value heads; ``A_log``/``dt_bias`` (per value head) and ``out_proj``'s input columns (value
heads x ``v_head_dim``) split the same way. The depthwise ``conv1d`` is the exception: its channels
are ``[q of every key head, k of every key head, v of every value head]``, so a contiguous split
would give a rank other heads' channels. ``relayout_params`` therefore reorders them once, at load
time, rank-major (``gated_delta_conv_channel_order``: rank 0's q, k and v channels, then rank 1's,
...; the identity at one rank), and the rule then splits them contiguously; the recurrent pool's
conv state is sharded the same way (rank ``r`` holds its heads' ``[q, k, v]`` window, SGLang's
per-rank layout). Each rank runs the whole mixer on its heads inside ``shard_map``
(``kvjax.attention.recurrent_step.recurrent_mixer_over_heads``) and ``out_proj`` ends in partial
sums: one all-reduce after the mixer, as after attention. Heads split only when the key heads
divide over the ranks (the model refuses other tp sizes: Qwen3-Next-80B's 16 key heads run at tp
1, 2, 4, 8 and 16).

Nemotron-H's Mamba2 mixers are head-parallel the same way, by B/C groups (a rank holds whole
groups and their heads; the grouped RMSNorm then stays per rank): ``in_proj``'s rows (``[gate, x,
B, C, dt]``) and the conv channels (``[x, B, C]``) are re-laid out rank-major at load
(``rank_major_order``), ``A_log``/``dt_bias``/``D`` and the norm weight split by heads, ``out_proj``
by its input columns. tp must divide ``n_groups`` (a single group, replicated over the ranks as
SGLang does, is refused by the model).

Decode context parallelism (a mesh with a ``"dcp"`` axis, ``kvjax.mesh_check``): as in SGLang,
DCP divides the TP group, so the weights stay split over all ``tp_size`` chips: every rule splits
over the two axes jointly, ``("tp", "dcp")`` tp-major (``weight_axes``). Device ``(t, d)`` then
holds query heads block ``t * dcp + d``, and the union of its ``"dcp"`` row's blocks is exactly
the query heads of the KV heads its ``"tp"`` rank holds: attention gathers them over ``"dcp"``
(``kvjax.attention.dcp_striped_layer``). KV heads split over more ranks than the pool's ``"tp"``
axis (``tp / dcp``) reach the attention through one all-gather over ``"dcp"`` (GSPMD's).

The entry point other code calls is ``shard_params(params, config, mesh)`` (re-layout, then
placement);
``param_shardings`` gives the ``NamedSharding`` tree without moving anything (for ``jax.jit``'s
``in_shardings`` or a deviceless compile over abstract params; re-layouts keep shapes, so the tree
holds for the re-laid params), and ``param_spec`` one weight's spec (what a model's ``shard_map``
takes as the weight's ``in_specs``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.serve.model_config import ModelConfig

__all__ = [
    "PARAM_RULES",
    "TP_AXIS",
    "ParamRule",
    "gated_delta_conv_channel_order",
    "param_partition_specs",
    "param_shardings",
    "param_spec",
    "rank_major_order",
    "relayout_params",
    "shard_params",
    "weight_axes",
]

TP_AXIS = "tp"
"""The mesh axis weights are split over (the pools' KV-head axis, ``kvjax.build.KV_HEAD_MESH_AXIS``)."""


DCP_AXIS = "dcp"
"""Under decode context parallelism, the mesh axis that joins ``"tp"`` in splitting the weights."""

Axes = str | tuple[str, ...]


def weight_axes(mesh: Mesh) -> Axes:
    """The mesh axes weights are split over: ``("tp", "dcp")`` (jointly, tp-major) on a mesh with
    a ``"dcp"`` axis, else ``"tp"`` (module docstring)."""
    return (TP_AXIS, DCP_AXIS) if DCP_AXIS in mesh.axis_names else TP_AXIS


def _ranks(mesh: Mesh, axis: Axes) -> int:
    names = (axis,) if isinstance(axis, str) else axis
    missing = [name for name in names if name not in mesh.axis_names]
    if missing:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}; weights are split over {axis!r}")
    return int(np.prod([mesh.shape[name] for name in names]))


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """Parameters whose ``/``-joined path matches ``pattern`` (``re.search``) are ``layout``
    (``"column"``: split over their output rows; ``"row"``: over their input columns) when
    ``unit(config)`` splits evenly over the ranks. ``relayout(config, ranks)``, when set, gives
    the order of the weight's rows (axis 0) that makes the contiguous split give each rank its
    whole units: ``relayout_params`` applies it once, at load time, where the rule splits."""

    pattern: str
    layout: str
    unit: Callable[[ModelConfig], int]
    relayout: Callable[[ModelConfig, int], np.ndarray] | None = None


def _query_heads(c: ModelConfig) -> int:
    return c.num_attention_heads


def _kv_heads(c: ModelConfig) -> int:
    return c.num_kv_heads


def _intermediate(c: ModelConfig) -> int:
    return c.intermediate_size


def _moe_intermediate(c: ModelConfig) -> int:
    """The routed experts' ``moe_intermediate_size`` (0, never split, for a config without
    ``kvjax.serve.moe`` experts)."""
    moe = getattr(c.family_config, "moe", None)
    return int(getattr(moe, "moe_intermediate_size", 0) or 0)


def _linear_key_heads(c: ModelConfig) -> int:
    """The gated delta net's key heads (0, never split, for a config without them)."""
    return int(getattr(c.family_config, "num_k_heads", 0) or 0)


def rank_major_order(sections: tuple[int, ...], ranks: int) -> np.ndarray:
    """Rows made of consecutive ``sections`` (sizes), each split evenly over ``ranks``, reordered
    rank-major: rank 0's part of every section in turn, then rank 1's, ... ``order[i]`` is the
    original row at position ``i``; the identity at one rank. ``ValueError`` naming the section
    that does not split."""
    for size in sections:
        if ranks < 1 or size % ranks:
            raise ValueError(f"a section of {size} rows does not split over {ranks} ranks")
    starts = np.cumsum((0, *sections[:-1]))
    return np.concatenate(
        [
            start + r * (size // ranks) + np.arange(size // ranks)
            for r in range(ranks)
            for start, size in zip(starts, sections, strict=True)
        ]
    )


def gated_delta_conv_channel_order(
    num_k_heads: int, k_head_dim: int, num_v_heads: int, v_head_dim: int, ranks: int
) -> np.ndarray:
    """The gated delta net's conv channels reordered rank-major: for each rank ``r`` of
    ``ranks``, its key heads' q channels, their k channels, then its value heads' v channels
    (Transformers' order is all q, all k, all v). ``order[i]`` is the Transformers channel at
    position ``i``; the identity at one rank. ``ValueError`` when the key heads do not divide."""
    if ranks < 1 or num_k_heads % ranks:
        raise ValueError(f"{num_k_heads} key heads do not split over {ranks} ranks")
    key, value = num_k_heads * k_head_dim, num_v_heads * v_head_dim
    return rank_major_order((key, key, value), ranks)


def _gated_delta_conv_order(c: ModelConfig, ranks: int) -> np.ndarray:
    f = c.family_config
    return gated_delta_conv_channel_order(f.num_k_heads, f.k_head_dim, f.num_v_heads, f.v_head_dim, ranks)


def _mamba_groups(c: ModelConfig) -> int:
    """A Mamba2 mixer's B/C groups (0, never split, for a config without them); its heads are a
    multiple, so whole groups per rank means whole heads too."""
    return int(getattr(c.family_config, "n_groups", 0) or 0)


def _mamba_sections(c: ModelConfig) -> tuple[int, int, int]:
    f = c.family_config
    return f.num_heads * f.head_dim, f.n_groups * f.state_size, f.num_heads


def _mamba_in_proj_order(c: ModelConfig, ranks: int) -> np.ndarray:
    inter, bc, heads = _mamba_sections(c)
    return rank_major_order((inter, inter, bc, bc, heads), ranks)  # gate, x, B, C, dt


def _mamba_conv_order(c: ModelConfig, ranks: int) -> np.ndarray:
    inter, bc, _ = _mamba_sections(c)
    return rank_major_order((inter, bc, bc), ranks)  # x, B, C


PARAM_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"(self_attn|mixer)/(q_proj|q_b_proj|kv_b_proj)/(weight|bias)$", "column", _query_heads),
    ParamRule(r"(self_attn|mixer)/(k_proj|v_proj)/(weight|bias)$", "column", _kv_heads),
    ParamRule(r"(self_attn|mixer)/o_proj/(weight|bias)$", "row", _query_heads),
    ParamRule(r"(^|/)(mlp|shared_experts?|mixer)/(gate_proj|up_proj)/(weight|bias)$", "column", _intermediate),
    ParamRule(r"(^|/)(mlp|shared_experts?|mixer)/down_proj/(weight|bias)$", "row", _intermediate),
    ParamRule(r"(^|/)experts_\d+/(gate_proj|up_proj)/weight$", "column", _moe_intermediate),
    ParamRule(r"(^|/)experts_\d+/down_proj/weight$", "row", _moe_intermediate),
    ParamRule(r"linear_attn/(in_proj_qkvz|in_proj_ba)/weight$", "column", _linear_key_heads),
    ParamRule(r"linear_attn/conv1d/weight$", "column", _linear_key_heads, _gated_delta_conv_order),
    ParamRule(r"linear_attn/(A_log|dt_bias)$", "column", _linear_key_heads),
    ParamRule(r"linear_attn/out_proj/weight$", "row", _linear_key_heads),
    ParamRule(r"(^|/)mixer/in_proj/(weight|bias)$", "column", _mamba_groups, _mamba_in_proj_order),
    ParamRule(r"(^|/)mixer/conv1d/(weight|bias)$", "column", _mamba_groups, _mamba_conv_order),
    ParamRule(r"(^|/)mixer/(A_log|dt_bias|D|norm/weight)$", "column", _mamba_groups),
    ParamRule(r"(^|/)mixer/out_proj/(weight|bias)$", "row", _mamba_groups),
)
"""The rule table of the module docstring, first match wins; no match: replicated."""


def _path(keys: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def _rule(path: str) -> ParamRule | None:
    return next((rule for rule in PARAM_RULES if re.search(rule.pattern, path)), None)


def _splits(rule: ParamRule, config: ModelConfig, ranks: int) -> bool:
    unit = rule.unit(config)
    return ranks > 1 and unit > 0 and unit % ranks == 0


def param_spec(path: str, shape: tuple[int, ...], config: ModelConfig, ranks: int, *, axis: Axes = TP_AXIS) -> P:
    """The ``PartitionSpec`` of the weight at ``path`` (``/``-joined parameter names; the rules
    match its end) of ``shape`` for ``ranks`` tensor-parallel ranks (module docstring)."""
    return _spec(path, tuple(shape), config, ranks, axis)


def _spec(path: str, shape: tuple[int, ...], config: ModelConfig, ranks: int, axis: Axes) -> P:
    rule = _rule(path)
    if ranks == 1 or rule is None or not _splits(rule, config, ranks):
        return P()
    if rule.layout == "column":
        dim = 0
    elif path.endswith("/bias"):
        return P()  # a row-parallel bias is added once, after the sum
    else:
        dim = len(shape) - 1
    if shape[dim] % ranks:
        return P()
    return P(*(axis if i == dim else None for i in range(len(shape))))


def param_partition_specs(params: Any, config: ModelConfig, ranks: int, *, axis: Axes = TP_AXIS) -> Any:
    """The ``PartitionSpec`` of every weight (a tree shaped like ``params``; leaves may be arrays
    or ``jax.ShapeDtypeStruct``) for ``ranks`` tensor-parallel ranks over mesh axis ``axis``."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: the tensor-parallel size must be at least 1")
    return jax.tree_util.tree_map_with_path(
        lambda keys, leaf: _spec(_path(keys), tuple(leaf.shape), config, ranks, axis), params
    )


def param_shardings(params: Any, config: ModelConfig, mesh: Mesh, *, axis: Axes | None = None) -> Any:
    """``NamedSharding``s over ``mesh`` of every weight (module docstring), split over ``axis``
    (default ``weight_axes(mesh)``); ``mesh`` must have it (``ValueError`` naming the mesh's axes
    otherwise)."""
    axis = weight_axes(mesh) if axis is None else axis
    specs = param_partition_specs(params, config, _ranks(mesh, axis), axis=axis)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def relayout_params(params: Any, config: ModelConfig, ranks: int) -> Any:
    """``params`` (Transformers' layout) with every weight whose rule has a ``relayout`` and splits
    over ``ranks`` reordered along axis 0 (module docstring: the gated delta net's conv channels,
    rank-major); other weights are returned as they are. Run once, at load time, before placing
    the weights (``shard_params`` does); the shapes do not change. At one rank: ``params``."""
    if ranks == 1:
        return params

    def relayout(keys: tuple[Any, ...], leaf: Any) -> Any:
        rule = _rule(_path(keys))
        if rule is None or rule.relayout is None or not _splits(rule, config, ranks):
            return leaf
        order = rule.relayout(config, ranks)
        if order.shape != (leaf.shape[0],):
            raise ValueError(f"{_path(keys)}: {leaf.shape[0]} rows, the re-layout orders {order.shape[0]}")
        return jnp.take(jnp.asarray(leaf), jnp.asarray(order), axis=0)

    return jax.tree_util.tree_map_with_path(relayout, params)


def shard_params(params: Any, config: ModelConfig, mesh: Mesh, *, axis: Axes | None = None) -> Any:
    """``params`` (Transformers' layout) re-laid out (``relayout_params``) and placed on ``mesh``
    Megatron style (module docstring; over ``axis``, default ``weight_axes(mesh)``): the tree
    other code passes to a sharded step (``kvjax.serve.step.make_sharded_step``). Idempotent:
    weights already placed as the rules say (the output of an earlier call) are kept as they are,
    not re-laid out twice."""
    axis = weight_axes(mesh) if axis is None else axis
    shardings = param_shardings(params, config, mesh, axis=axis)
    placed = zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)
    if all(getattr(w, "sharding", None) == s for w, s in placed):
        return params
    params = relayout_params(params, config, _ranks(mesh, axis))
    return jax.device_put(params, shardings)
