"""The DP-attention serving step's inputs as abstract values: lower and compile
``kvjax.dp.step.make_dp_step`` over a ``("data", "tp")`` mesh of a TPU slice that is not here.

``abstract_dp_step_inputs(spec, config, mesh, batch)`` gives what ``make_dp_step(spec,
layout).jitted`` takes, as ``jax.ShapeDtypeStruct`` leaves carrying the shardings the DP step
lays its arguments out with, and the ``DPLayout``:

* ``pools``: what ``build_dp_kv_cache(spec, config, mesh)`` builds (every pool array with a
  leading rank axis over ``"data"``, KV heads over ``"tp"``, an MLA latent replicated over
  ``"tp"``), nothing allocated: the build is traced (its device pools are made by a jitted
  ``shard_map``, so tracing gives their shapes; the ranks' host state is built on the host, small)
  and its layout read from the build.
* ``params``: the model's parameter tree with ``param_sharding``'s splits over ``"tp"``
  (replicated over ``"data"``): weights as shapes only.
* ``tokens`` ``[dp, T]`` / ``meta`` (leaves ``[dp, ...]``): every rank decoding the same
  :class:`~kvjax.serve.abstract_step.DecodeBatch` (its own pages, rank-local ids), stacked by
  ``kvjax.dp.attention.stack_rank_inputs`` as the DP scheduler stacks them, by rank over
  ``"data"`` (``host_sharding``).

:func:`dp_topology_mesh` is the ``("data", "tp")`` mesh of a TPU topology's chips (rank ``r`` is
chips ``r * tp .. (r + 1) * tp - 1`` in the topology's device order), no TPU needed (libtpu must
be importable). :func:`lower_dp_step` lowers the step for the inputs; ``.compile()`` gives the
program one chip runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from kvjax.attention import AttentionMetadata
from kvjax.config import CacheConfig
from kvjax.dp.attention import stack_rank_inputs
from kvjax.dp.cache import DPLayout, build_dp_kv_cache
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding
from kvjax.dp.step import make_dp_step
from kvjax.plan import plan_kv_cache
from kvjax.pools import CachePools
from kvjax.serve.abstract_step import DecodeBatch, decode_batch
from kvjax.serve.model import as_model_config, param_shapes
from kvjax.serve.param_sharding import param_shardings
from kvjax.spec import ModelSpec

__all__ = [
    "AbstractDPStepInputs",
    "abstract_dp_pools",
    "abstract_dp_step_inputs",
    "abstract_params",
    "dp_topology_mesh",
    "lower_dp_step",
    "on_platform",
]


@dataclasses.dataclass(frozen=True)
class AbstractDPStepInputs:
    """The DP step's arguments as ``ShapeDtypeStruct`` trees with shardings, and the layout the
    step is made for (module docstring). ``tokens`` is ``[dp, T]``; ``T`` is one rank's tokens."""

    layout: DPLayout
    pools: CachePools
    params: Any
    tokens: jax.ShapeDtypeStruct
    meta: AttentionMetadata


def dp_topology_mesh(topology: str, dp_size: int, tp_size: int) -> Mesh:
    """The ``("data", "tp")`` mesh (``Auto`` axes) of ``dp_size`` ranks of ``tp_size`` chips over
    the first ``dp_size * tp_size`` chips of the TPU topology ``topology`` (e.g. ``"v5p:2x2x4"``);
    ``ValueError`` when the topology has fewer chips."""
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    if dp_size * tp_size > len(devices) or dp_size < 1 or tp_size < 1:
        raise ValueError(f"dp {dp_size} x tp {tp_size} chips do not fit {topology!r}'s {len(devices)} chips")
    grid = np.array(devices[: dp_size * tp_size], dtype=object).reshape(dp_size, tp_size)
    return Mesh(grid, (DATA_MESH_AXIS, "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


def on_platform(config: CacheConfig, mesh: Mesh) -> CacheConfig:
    """``config`` planned for the platform of ``mesh``'s chips unless it names one."""
    if config.platform is None:
        return config.replace(platform=str(mesh.devices.flat[0].platform))
    return config


def abstract_dp_pools(spec: ModelSpec, config: CacheConfig, mesh: Mesh) -> tuple[DPLayout, CachePools]:
    """``(layout, pools)`` of ``build_dp_kv_cache(spec, config, mesh)``: its layout, and its
    stacked device pools as ``ShapeDtypeStruct`` leaves with their shardings; nothing allocated
    (module docstring)."""
    config = on_platform(config, mesh)
    layouts: list[DPLayout] = []

    def allocate() -> CachePools:
        cache = build_dp_kv_cache(spec, config, mesh)
        layouts.append(cache.layout)
        return cache.pools

    traced = jax.jit(allocate).trace()
    shardings = traced.lower().compile().output_shardings
    pools = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        traced.out_info,
        shardings,
    )
    return layouts[0], pools


def abstract_params(shapes: Any, spec: ModelSpec, mesh: Mesh) -> Any:
    """A parameter tree of ``ShapeDtypeStruct`` leaves (``param_shapes``, ``nextn_param_shapes``)
    with ``param_sharding``'s splits of ``spec``'s model over ``mesh``'s ``"tp"``: weights as
    shapes only."""
    model = as_model_config(spec)
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes,
        param_shardings(shapes, model, mesh),
    )


def abstract_dp_step_inputs(
    spec: ModelSpec, config: CacheConfig, mesh: Mesh, batch: DecodeBatch
) -> AbstractDPStepInputs:
    """The DP step's arguments for every rank decoding ``batch`` over ``mesh`` (module docstring).

    ``config`` has ``enable_dp_attention`` with ``dp_size`` and ``tp_size`` matching ``mesh``
    (``tp_size / dp_size`` chips per rank). Raises the build's errors (``ConfigError`` for a mesh
    or config that do not match, ``NotImplementedError`` for a tier not built under DP attention)
    and ``ValueError`` for a model with device pools besides ``kv`` or a batch one rank's pool
    cannot hold."""
    layout, pools = abstract_dp_pools(spec, config, mesh)
    if pools.names != ("kv",):
        raise ValueError(
            f"{spec.name} has device pools {list(pools.names)}; abstract DP decode batches are built for "
            "models whose only device pool is 'kv' (full attention or MLA)"
        )
    # one rank's plan: the rank's pool size (every rank's plan is the same)
    plan = plan_kv_cache(spec, on_platform(config, mesh))
    tokens, meta = decode_batch(batch, plan.page_size, plan.max_total_tokens)
    stacked_tokens, stacked_meta = stack_rank_inputs([tokens] * layout.dp_size, [meta] * layout.dp_size)
    by_rank = host_sharding(layout.mesh)

    def abstract(array: Any) -> jax.ShapeDtypeStruct:
        array = np.asarray(array)
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=by_rank)

    return AbstractDPStepInputs(
        layout=layout,
        pools=pools,
        params=abstract_params(param_shapes(as_model_config(spec)), spec, layout.mesh),
        tokens=abstract(stacked_tokens),
        meta=jax.tree.map(abstract, stacked_meta),
    )


def lower_dp_step(spec: ModelSpec, inputs: AbstractDPStepInputs, *, with_logits: bool = False) -> jax.stages.Lowered:
    """``make_dp_step(spec, inputs.layout)`` lowered for ``inputs`` (no future tokens): the DP
    serving step as the DP scheduler jits it, ready to ``.compile()``."""
    step = make_dp_step(spec, inputs.layout, with_logits=with_logits)
    jitted: Any = step.jitted  # type: ignore[attr-defined]
    return jitted.trace(inputs.pools, inputs.params, inputs.tokens, inputs.meta, None, None).lower()
