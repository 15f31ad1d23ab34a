"""The sharded serving step's inputs as abstract values: lower and compile the real step over a
mesh whose devices are not here (a TPU slice described by its topology, on a CPU-only host).

``abstract_step_inputs(spec, config, mesh, batch)`` gives ``(pools, params, tokens, meta)`` as
``jax.ShapeDtypeStruct`` leaves carrying the ``NamedSharding`` over ``mesh`` each argument has when
serving, exactly what ``kvjax.serve.step.make_sharded_step(spec, mesh, pools).jitted`` takes:

* ``pools``: what ``build_kv_cache(spec, config, mesh=mesh)`` allocates, nothing allocated. The
  build is traced (its arrays are created by jitted functions, so tracing gives their shapes) and
  the allocation compiled, not run, for the shardings it lays the arrays out with (KV heads over
  ``"tp"``, an MLA latent replicated).
* ``params``: the model's parameter tree (``kvjax.serve.model.param_shapes``) with
  ``kvjax.serve.param_sharding.param_shardings`` (Megatron column/row splits).
* ``tokens`` / ``meta``: one decode batch (:class:`DecodeBatch`), packed by the host metadata
  builder (``kvjax.attention.build_attention_metadata``) as the scheduler packs it, replicated.

:func:`lower_sharded_step` lowers the step itself for them; ``.compile()`` on the result gives the program
XLA would run on those devices (its text, ``memory_analysis()``, ``cost_analysis()``).
:func:`topology_mesh` is the ``("tp",)`` mesh of a TPU topology's chips without a TPU
(``jax.experimental.topologies``; needs libtpu installed). :func:`decode_batch` gives the same
batch as numpy arrays, to run the step on real devices.

Decode batches are built for models whose only device pool is ``kv`` (full attention or MLA):
the metadata of sliding-window and recurrent pools is per-request state the scheduler owns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata, build_attention_metadata
from kvjax.attention.sharding import serving_mesh
from kvjax.build import build_kv_cache
from kvjax.config import CacheConfig
from kvjax.mesh_check import make_serving_mesh
from kvjax.plan import plan_kv_cache
from kvjax.pools import CachePools
from kvjax.serve.model import as_model_config, param_shapes
from kvjax.serve.param_sharding import param_shardings
from kvjax.serve.step import make_sharded_step
from kvjax.spec import ModelSpec

__all__ = [
    "DEEPSEEK_V3_AS_V2",
    "AbstractStepInputs",
    "DecodeBatch",
    "abstract_pools",
    "abstract_step_inputs",
    "bytes_per_device",
    "decode_batch",
    "lower_sharded_step",
    "sized_like",
    "topology_mesh",
]


#: ``sized_like("deepseek-v3", ..., **DEEPSEEK_V3_AS_V2)``: DeepSeek-V3's layer sizes served by
#: kvjax's ``deepseek_v2`` model, the same MLA layer (V3's YaRN RoPE, sigmoid router and fp8 weights
#: are not built; none changes a dense MLA layer's shapes or collectives). Its first three layers
#: have a dense MLP, so a model of up to three layers has no MoE.
DEEPSEEK_V3_AS_V2: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "rope_scaling": None,
    "quantization_config": None,
}


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """``seqs`` sequences decoding one token each, every one at ``context`` tokens (the new token
    included): sequence ``s`` owns pages ``1 + s * pages_per_seq ...`` (page 0 is the trash page)
    and writes its token at position ``context - 1``."""

    seqs: int
    context: int

    def __post_init__(self) -> None:
        if self.seqs < 1 or self.context < 1:
            raise ValueError(f"DecodeBatch(seqs={self.seqs}, context={self.context}): both must be at least 1")

    def pages_per_seq(self, page_size: int) -> int:
        return -(-self.context // page_size)


@dataclasses.dataclass(frozen=True)
class AbstractStepInputs:
    """The sharded step's arguments as ``ShapeDtypeStruct`` trees with shardings (module docstring)."""

    pools: CachePools
    params: Any
    tokens: jax.ShapeDtypeStruct
    meta: AttentionMetadata


def sized_like(preset: str, *, num_layers: int, vocab_size: int, **changes: Any) -> ModelSpec:
    """The shipped preset ``preset`` (its ``config.json``) cut to ``num_layers`` decoder layers and
    a ``vocab_size``-token vocabulary, with ``changes`` applied to the config (a key set to None is
    removed): a model with the preset's layer sizes that compiles in seconds."""
    raw = {**ModelSpec.preset(preset).extra, "num_hidden_layers": num_layers, "vocab_size": vocab_size, **changes}
    raw = {key: value for key, value in raw.items() if value is not None}
    name = f"{preset} ({num_layers} layers, vocab {vocab_size})"
    return ModelSpec.from_hf_config(raw, name=name)


def topology_mesh(topology: str, tp_size: int | None = None) -> Mesh:
    """The ``("tp",)`` serving mesh (``Auto`` axes) over the first ``tp_size`` chips (default: all)
    of the TPU topology ``topology`` (e.g. ``"v5e:2x4"``), no TPU needed; libtpu must be
    importable (the ``tpu`` extra)."""
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    return serving_mesh(make_serving_mesh(len(devices) if tp_size is None else tp_size, devices=devices))


def _platform_config(config: CacheConfig, mesh: Mesh) -> CacheConfig:
    if config.platform is None:
        return config.replace(platform=str(mesh.devices.flat[0].platform))
    return config


def abstract_pools(spec: ModelSpec, config: CacheConfig, mesh: Mesh) -> CachePools:
    """The device pools ``build_kv_cache(spec, config, mesh=mesh)`` builds, as ``ShapeDtypeStruct``
    leaves with their shardings; nothing is allocated (module docstring)."""
    mesh = serving_mesh(mesh)

    def allocate() -> CachePools:
        return build_kv_cache(spec, config, mesh=mesh).pools

    traced = jax.jit(allocate).trace()
    shardings = traced.lower().compile().output_shardings
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        traced.out_info,
        shardings,
    )


def decode_batch(batch: DecodeBatch, page_size: int, pool_tokens: int) -> tuple[np.ndarray, AttentionMetadata]:
    """``(tokens [T], meta)`` of ``batch`` as numpy arrays (token ids 0), for a pool of
    ``pool_tokens`` allocatable token slots in pages of ``page_size``; ``ValueError`` naming the
    sizes when the batch's pages do not fit."""
    pages = batch.pages_per_seq(page_size)
    if batch.seqs * pages * page_size > pool_tokens:
        raise ValueError(
            f"{batch.seqs} sequences of {batch.context} tokens need {batch.seqs * pages * page_size} token slots "
            f"(pages of {page_size}); the pool has {pool_tokens}: raise max_total_tokens or lower seqs/context"
        )
    table = 1 + np.arange(batch.seqs * pages, dtype=np.int32).reshape(batch.seqs, pages)
    position = batch.context - 1
    slots = table[:, position // page_size] * page_size + position % page_size
    return build_attention_metadata(
        tokens=np.zeros(batch.seqs, np.int32),
        starts=np.full(batch.seqs, position, np.int32),
        slots=slots,
        page_table=table,
        max_seqs=batch.seqs,
    )


def abstract_step_inputs(spec: ModelSpec, config: CacheConfig, mesh: Mesh, batch: DecodeBatch) -> AbstractStepInputs:
    """The sharded step's arguments for ``batch`` over ``mesh`` (module docstring). Raises
    ``ValueError`` for a model with device pools besides ``kv`` or a batch the pool cannot hold,
    and the build's own errors (``ConfigError``) for a mesh that does not match ``config``."""
    mesh = serving_mesh(mesh)
    config = _platform_config(config, mesh)
    plan = plan_kv_cache(spec, config)
    pools = abstract_pools(spec, config, mesh)
    if pools.names != ("kv",):
        raise ValueError(
            f"{spec.name} has device pools {list(pools.names)}; abstract decode batches are built for "
            "models whose only device pool is 'kv' (full attention or MLA)"
        )
    tokens, meta = decode_batch(batch, plan.page_size, plan.max_total_tokens)
    replicated = NamedSharding(mesh, P())

    def abstract(array: Any) -> jax.ShapeDtypeStruct:
        array = np.asarray(array)
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=replicated)

    model = as_model_config(spec)
    shapes = param_shapes(model)
    params = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes,
        param_shardings(shapes, model, mesh),
    )
    return AbstractStepInputs(pools=pools, params=params, tokens=abstract(tokens), meta=jax.tree.map(abstract, meta))


def lower_sharded_step(
    spec: ModelSpec, mesh: Mesh, inputs: AbstractStepInputs, *, with_logits: bool = False
) -> jax.stages.Lowered:
    """``make_sharded_step(spec, mesh, inputs.pools)`` lowered for ``inputs``
    (:func:`abstract_step_inputs`, no future tokens): the serving step as the scheduler jits it,
    ready to ``.compile()``."""
    step = make_sharded_step(spec, mesh, inputs.pools, with_logits=with_logits)
    jitted: Any = step.jitted  # type: ignore[attr-defined]
    return jitted.trace(inputs.pools, inputs.params, inputs.tokens, inputs.meta, None, None).lower()


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of ``ShapeDtypeStruct`` leaves with shardings (or arrays):
    each leaf's shard shape times its item size, summed."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total
