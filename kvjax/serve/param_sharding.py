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
everything else (embeddings, norms, LM head, MLA's latent    replicated: ``P()``
``kv_a_proj_with_mqa`` and ``q_a_proj``, routers, experts,
recurrent mixers)
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

MLA (DeepSeek-V2/V3): the latent ``c_kv``/``k_pe`` is one shared row per token, not per head, so
its projection (``kv_a_proj_with_mqa``) is replicated and every rank writes the same rows into its
replica of the latent pool (``kvjax.pools.mla``: replicated over TP, as sglang-jax does). Splitting
the latent would need an all-gather before every attention (each head reads all of it); replicating
costs ``tp`` times its memory instead, which DP attention avoids by giving each rank its own requests.
The query heads and the per-head ``kv_b_proj`` are split, so attention itself is head-parallel.

The entry point other code calls is ``shard_params(params, config, mesh)``;
``param_shardings`` gives the ``NamedSharding`` tree without moving anything (for ``jax.jit``'s
``in_shardings`` or a deviceless compile over abstract params).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.serve.model_config import ModelConfig

__all__ = ["TP_AXIS", "PARAM_RULES", "ParamRule", "param_partition_specs", "param_shardings", "shard_params"]

TP_AXIS = "tp"
"""The mesh axis weights are split over (the pools' KV-head axis, ``kvjax.build.KV_HEAD_MESH_AXIS``)."""


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """Parameters whose ``/``-joined path matches ``pattern`` (``re.search``) are ``layout``
    (``"column"``: split over their output rows; ``"row"``: over their input columns) when
    ``unit(config)`` splits evenly over the ranks."""

    pattern: str
    layout: str
    unit: Callable[[ModelConfig], int]


def _query_heads(c: ModelConfig) -> int:
    return c.num_attention_heads


def _kv_heads(c: ModelConfig) -> int:
    return c.num_kv_heads


def _intermediate(c: ModelConfig) -> int:
    return c.intermediate_size


PARAM_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"self_attn/(q_proj|q_b_proj|kv_b_proj)/(weight|bias)$", "column", _query_heads),
    ParamRule(r"self_attn/(k_proj|v_proj)/(weight|bias)$", "column", _kv_heads),
    ParamRule(r"self_attn/o_proj/(weight|bias)$", "row", _query_heads),
    ParamRule(r"(^|/)(mlp|shared_experts)/(gate_proj|up_proj)/(weight|bias)$", "column", _intermediate),
    ParamRule(r"(^|/)(mlp|shared_experts)/down_proj/(weight|bias)$", "row", _intermediate),
)
"""The rule table of the module docstring, first match wins; no match: replicated."""


def _path(keys: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def _spec(path: str, shape: tuple[int, ...], config: ModelConfig, ranks: int, axis: str) -> P:
    if ranks == 1:
        return P()
    for rule in PARAM_RULES:
        if not re.search(rule.pattern, path):
            continue
        if rule.unit(config) % ranks:
            return P()
        is_bias = path.endswith("/bias")
        if rule.layout == "column":
            dim = 0
        elif is_bias:
            return P()  # a row-parallel bias is added once, after the sum
        else:
            dim = len(shape) - 1
        if shape[dim] % ranks:
            return P()
        return P(*(axis if i == dim else None for i in range(len(shape))))
    return P()


def param_partition_specs(params: Any, config: ModelConfig, ranks: int, *, axis: str = TP_AXIS) -> Any:
    """The ``PartitionSpec`` of every weight (a tree shaped like ``params``; leaves may be arrays
    or ``jax.ShapeDtypeStruct``) for ``ranks`` tensor-parallel ranks over mesh axis ``axis``."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: the tensor-parallel size must be at least 1")
    return jax.tree_util.tree_map_with_path(
        lambda keys, leaf: _spec(_path(keys), tuple(leaf.shape), config, ranks, axis), params
    )


def param_shardings(params: Any, config: ModelConfig, mesh: Mesh, *, axis: str = TP_AXIS) -> Any:
    """``NamedSharding``s over ``mesh`` of every weight (module docstring); ``mesh`` must have
    ``axis`` (``ValueError`` naming the mesh's axes otherwise)."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}; weights are split over {axis!r}")
    specs = param_partition_specs(params, config, int(mesh.shape[axis]), axis=axis)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(params: Any, config: ModelConfig, mesh: Mesh, *, axis: str = TP_AXIS) -> Any:
    """``params`` placed on ``mesh`` Megatron style (module docstring): the tree other code passes
    to a sharded step (``kvjax.serve.step.make_step(..., mesh=mesh)``)."""
    return jax.device_put(params, param_shardings(params, config, mesh, axis=axis))
