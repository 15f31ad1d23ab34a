"""One tensor-parallel decoder layer's serving step, self-contained: what the TPU compile tests and
``benchmarks/mesh.py`` compile (and, on CPU, run) to count a layer's collectives and temporaries.

Two layers at real sizes, Megatron-sharded over a mesh's ``"tp"`` axis
(``kvjax.mesh_check.KV_HEAD_AXIS``) with ``NamedSharding``:

* ``LLAMA_3_8B``: RMSNorm -> q/k/v (column-parallel: each device computes its own query and KV
  heads) -> rotary -> ``kvjax.attention.attend`` (write the new K/V into the paged pool, sharded
  over KV heads, and attend, the Pallas kernel inside ``shard_map``) -> o (row-parallel: partial
  sums, one all-reduce) -> residual -> RMSNorm -> SwiGLU MLP (gate/up column-parallel, down
  row-parallel: one all-reduce) -> residual.
* ``DEEPSEEK_V3``: the MLA layer in absorbed form (``kvjax.attention.attend`` with
  ``q = (q_latent, q_rope)``): the low-rank ``q_a`` and ``kv_a`` projections are replicated
  (every device computes the shared latent ``c_kv`` and ``k_pe`` itself, so the latent pool is
  replicated over TP, as sglang-jax does), ``q_b``, ``W_UK``, ``W_UV`` and ``o`` are split by query
  heads (16 of 128 per device at TP 8), then a dense SwiGLU MLP (DeepSeek-V3's first layers).

Both need exactly Megatron's minimum of collectives: two all-reduces of ``tokens x hidden``
activations per layer (:func:`megatron_all_reduce_bytes`), the activations between layers
replicated. The pools are donated: the write is in place.

The step is jitted with explicit input and output shardings and the pools donated
(:func:`jit_layer_step`). :func:`layer_inputs` gives the arguments as ``ShapeDtypeStruct``
(for a deviceless compile) or as arrays (to run it). :func:`collectives` reads a compiled
program's collectives and their bytes from its text.

This is a probe of the sharding, not a model: weights are random, one layer, one batch shape.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import attend
from kvjax.attention.metadata import AttentionMetadata
from kvjax.mesh_check import KV_HEAD_AXIS
from kvjax.pools import CachePools, MHAKVPool, MLAKVPool
from kvjax.pools.mha_layout import MHALayout
from kvjax.pools.mla_layout import MLALayout

__all__ = [
    "DEEPSEEK_V3",
    "LLAMA_3_8B",
    "Collective",
    "DecodeBatchShape",
    "DecoderLayerShape",
    "MLALayerShape",
    "collectives",
    "jit_layer_step",
    "layer_inputs",
    "layer_step",
    "megatron_all_reduce_bytes",
    "pool_bytes_per_device",
    "tp_mesh",
]

TP = KV_HEAD_AXIS
EPS = 1e-6
ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBatchShape:
    """One decode batch over one layer's paged pool, the part every layer shape has.

    ``seqs`` sequences decode one token each (``tokens == seqs``) at ``context`` tokens; the pool
    of one layer has ``pool_pages`` allocatable pages of ``page_size`` tokens (plus the trash
    page); ``dtype`` is the compute and pool dtype.
    """

    page_size: int
    pool_pages: int
    seqs: int
    context: int
    dtype: str = "bfloat16"

    @property
    def tokens(self) -> int:
        return self.seqs

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderLayerShape(DecodeBatchShape):
    """A Llama-style decoder layer (its pool over all KV heads) and one decode batch."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLALayerShape(DecodeBatchShape):
    """A DeepSeek-V3-style MLA layer with a dense MLP, and one decode batch."""

    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int


LayerShape = DecoderLayerShape | MLALayerShape

# Llama-3-8B: 4096 wide, 32 query heads, 8 KV heads of 128, MLP 14336; a 2 GiB bf16 pool per layer
# (256 MiB per chip at TP 8); 64 sequences decoding at 2k context.
LLAMA_3_8B = DecoderLayerShape(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    page_size=16,
    pool_pages=(2 << 30) // (16 * 2 * 8 * 128 * 2) - 1,
    seqs=64,
    context=2048,
)
# DeepSeek-V3: 7168 wide, 128 heads, q_lora 1536, kv_lora 512 + rope 64 (a 640-lane row on TPU),
# dense MLP 18432 (its first three layers); a 256 MiB latent pool per layer, on every chip.
DEEPSEEK_V3 = MLALayerShape(
    hidden=7168,
    heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate=18432,
    page_size=64,
    pool_pages=(256 << 20) // (64 * 640 * 2) - 1,
    seqs=64,
    context=2048,
)


def tp_mesh(devices: Any) -> Mesh:
    """A one-axis ``("tp",)`` mesh over ``devices`` (any array-like of devices)."""
    return Mesh(np.asarray(devices, dtype=object).reshape(-1), (TP,))


def megatron_all_reduce_bytes(shape: LayerShape) -> int:
    """Megatron's minimum per layer: one all-reduce of the ``[tokens, hidden]`` activations after
    attention and one after the MLP (bytes of the reduced arrays, in the compute dtype)."""
    return 2 * shape.tokens * shape.hidden * jnp.dtype(shape.dtype).itemsize


def _platform(mesh: Mesh) -> str:
    return str(mesh.devices.flat[0].platform)


# --- the pool ------------------------------------------------------------------------------------


def _mha_layout(shape: DecoderLayerShape, platform: str) -> MHALayout:
    return MHALayout.for_platform(
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        v_head_dim=shape.head_dim,
        page_size=shape.page_size,
        dtype=shape.dtype,
        platform=platform,
    )


def _mla_layout(shape: MLALayerShape, platform: str) -> MLALayout:
    return MLALayout.for_platform(
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        page_size=shape.page_size,
        dtype=shape.dtype,
        platform=platform,
    )


def _pool_struct(shape: LayerShape, mesh: Mesh) -> CachePools:
    """The one-layer pool as ``ShapeDtypeStruct`` leaves: MHA sharded over KV heads, the MLA
    latent replicated."""
    platform = _platform(mesh)
    replicated = NamedSharding(mesh, P())
    # ShapeDtypeStruct leaves stand in for the arrays (typed Any: the pools declare jax.Array).
    scale: Any = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=replicated)
    dtype = jnp.dtype(shape.dtype)
    layer: Any
    if isinstance(shape, DecoderLayerShape):
        layout = _mha_layout(shape, platform)
        layer = jax.ShapeDtypeStruct(
            layout.shape(shape.pool_pages), dtype, sharding=NamedSharding(mesh, P(None, None, TP, None))
        )
        pool: Any = MHAKVPool(
            kv=(layer,),
            k_scale=scale,
            v_scale=scale,
            page_size=shape.page_size,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            v_head_dim=layout.v_head_dim,
            dtype=shape.dtype,
            mesh=mesh,
            kv_head_axis=TP,
        )
    else:
        row = _mla_layout(shape, platform).row_padded
        layer = jax.ShapeDtypeStruct((shape.pool_pages + 1, shape.page_size, row), dtype, sharding=replicated)
        pool = MLAKVPool(
            kv=(layer,),
            scale=scale,
            page_size=shape.page_size,
            kv_lora_rank=shape.kv_lora_rank,
            qk_rope_head_dim=shape.qk_rope_head_dim,
            dtype=shape.dtype,
        )
    return CachePools({"kv": pool})


def pool_bytes_per_device(shape: LayerShape, mesh: Mesh) -> int:
    """Bytes of the layer's pool on one device (the MHA pool split over ``"tp"``, the latent whole)."""
    layer = _pool_struct(shape, mesh).kv.kv[0]
    shard = layer.sharding.shard_shape(layer.shape)
    return math.prod(shard) * layer.dtype.itemsize


# --- weights -------------------------------------------------------------------------------------

COLUMN, ROW, REPLICATED, HEADS_FIRST = P(None, TP), P(TP, None), P(), P(TP, None, None)


def _weight_specs(shape: LayerShape) -> dict[str, tuple[tuple[int, ...], P]]:
    """Each weight's shape and partition: column-parallel (outputs split), row-parallel (inputs
    split), split by heads, or replicated."""
    h = shape.hidden
    mlp = {
        "ln2": ((h,), REPLICATED),
        "w_gate": ((h, shape.intermediate), COLUMN),
        "w_up": ((h, shape.intermediate), COLUMN),
        "w_down": ((shape.intermediate, h), ROW),
    }
    if isinstance(shape, DecoderLayerShape):
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        return {
            "ln1": ((h,), REPLICATED),
            "w_q": ((h, q), COLUMN),
            "w_k": ((h, kv), COLUMN),
            "w_v": ((h, kv), COLUMN),
            "w_o": ((q, h), ROW),
            **mlp,
        }
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    return {
        "ln1": ((h,), REPLICATED),
        "w_q_a": ((h, shape.q_lora_rank), REPLICATED),
        "q_a_ln": ((shape.q_lora_rank,), REPLICATED),
        "w_q_b": ((shape.q_lora_rank, shape.heads * qk), COLUMN),
        "w_kv_a": ((h, shape.kv_lora_rank + shape.qk_rope_head_dim), REPLICATED),
        "kv_a_ln": ((shape.kv_lora_rank,), REPLICATED),
        "w_uk": ((shape.heads, shape.qk_nope_head_dim, shape.kv_lora_rank), HEADS_FIRST),
        "w_uv": ((shape.heads, shape.kv_lora_rank, shape.v_head_dim), HEADS_FIRST),
        "w_o": ((shape.heads * shape.v_head_dim, h), ROW),
        **mlp,
    }


# --- inputs --------------------------------------------------------------------------------------


def _metadata(shape: LayerShape, concrete: bool, sharding: NamedSharding) -> AttentionMetadata:
    """One decode step: sequence ``s`` owns pages ``1 + s * pages_per_seq ...`` and writes its
    ``context``-th token at the last position."""
    s, pps, page = shape.seqs, shape.pages_per_seq, shape.page_size
    table = 1 + np.arange(s * pps, dtype=np.int32).reshape(s, pps)
    position = shape.context - 1
    values = {
        "positions": np.full((s,), position, np.int32),
        "out_loc": table[:, position // page] * page + position % page,
        "kv_lens": np.full((s,), shape.context, np.int32),
        "page_indices": table,
        "cu_q_lens": np.arange(s + 1, dtype=np.int32),
        "num_seqs": np.array([s], np.int32),
        "logits_indices": np.arange(s, dtype=np.int32),
    }
    leaves: dict[str, Any] = {
        k: jax.device_put(v.astype(np.int32), sharding)
        if concrete
        else jax.ShapeDtypeStruct(v.shape, jnp.int32, sharding=sharding)
        for k, v in values.items()
    }
    return AttentionMetadata(**leaves)


def layer_inputs(shape: LayerShape, mesh: Mesh, *, concrete: bool = False, seed: int = 0) -> tuple[Any, ...]:
    """``(weights, pools, x, meta)`` of one step: ``ShapeDtypeStruct`` leaves carrying their
    shardings (``concrete=False``, for a deviceless compile), or arrays placed on ``mesh``
    (random weights and activations, a zero pool with unit scales)."""
    if shape.seqs * shape.pages_per_seq > shape.pool_pages:
        raise ValueError(
            f"{shape.seqs} sequences of {shape.context} tokens need {shape.seqs * shape.pages_per_seq} pages; "
            f"the pool has {shape.pool_pages}: raise pool_pages or lower seqs/context"
        )
    dtype = jnp.dtype(shape.dtype)
    replicated = NamedSharding(mesh, P())
    specs = _weight_specs(shape)
    pools = _pool_struct(shape, mesh)
    x_struct = jax.ShapeDtypeStruct((shape.tokens, shape.hidden), dtype, sharding=replicated)
    meta = _metadata(shape, concrete, replicated)
    if not concrete:
        structs = {
            name: jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, spec))
            for name, (dims, spec) in specs.items()
        }
        return structs, pools, x_struct, meta
    rng = np.random.default_rng(seed)

    def place(dims: tuple[int, ...], spec: P, scale: float) -> jax.Array:
        value = rng.standard_normal(dims, dtype=np.float32) * scale if scale else np.ones(dims, np.float32)
        return jax.device_put(jnp.asarray(value, dtype), NamedSharding(mesh, spec))

    weights = {
        name: place(dims, spec, 0.0 if name.endswith("ln") or name.startswith("ln") else 0.02)
        for name, (dims, spec) in specs.items()
    }
    pools = jax.tree.map(
        lambda s: jax.device_put(
            np.ones(s.shape, s.dtype) if s.dtype == jnp.float32 else np.zeros(s.shape, s.dtype), s.sharding
        ),
        pools,
    )
    x = place((shape.tokens, shape.hidden), P(), 1.0)
    return weights, pools, x, meta


# --- the step ------------------------------------------------------------------------------------


def _rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _rotary(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding over the last axis of ``x`` ``[T, ..., d]``."""
    half = x.shape[-1] // 2
    freq = ROPE_THETA ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq[None, :]
    angle = angle.reshape(angle.shape[0], *([1] * (x.ndim - 2)), half)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _swiglu(w: dict[str, jax.Array], x: jax.Array, replicated: NamedSharding) -> jax.Array:
    h = _rms_norm(x, w["ln2"])
    act = jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])
    return x + jax.lax.with_sharding_constraint(act @ w["w_down"], replicated)  # all-reduce 2


def layer_step(shape: LayerShape, mesh: Mesh) -> Callable[..., tuple[jax.Array, CachePools]]:
    """The layer's step ``(weights, pools, x, meta) -> (x, pools)`` (not jitted)."""
    replicated = NamedSharding(mesh, P())
    heads = NamedSharding(mesh, P(None, TP, None))
    t = shape.tokens

    if isinstance(shape, DecoderLayerShape):
        scale = shape.head_dim**-0.5

        def mha_step(w: dict[str, jax.Array], pools: CachePools, x: jax.Array, meta: AttentionMetadata) -> Any:
            h = _rms_norm(x, w["ln1"])
            q = jax.lax.with_sharding_constraint((h @ w["w_q"]).reshape(t, shape.heads, shape.head_dim), heads)
            k = jax.lax.with_sharding_constraint((h @ w["w_k"]).reshape(t, shape.kv_heads, shape.head_dim), heads)
            v = jax.lax.with_sharding_constraint((h @ w["w_v"]).reshape(t, shape.kv_heads, shape.head_dim), heads)
            q, k = _rotary(q, meta.positions), _rotary(k, meta.positions)
            out, pools = attend(pools, 0, q, k, v, meta, sm_scale=scale)
            attn = out.reshape(t, shape.heads * shape.head_dim) @ w["w_o"]
            x = x + jax.lax.with_sharding_constraint(attn, replicated)  # all-reduce 1
            return _swiglu(w, x, replicated), pools

        return mha_step

    mla = shape
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    sm_scale = qk**-0.5

    def mla_step(w: dict[str, jax.Array], pools: CachePools, x: jax.Array, meta: AttentionMetadata) -> Any:
        h = _rms_norm(x, w["ln1"])
        q_a = _rms_norm(h @ w["w_q_a"], w["q_a_ln"])  # replicated: every device computes it
        q = jax.lax.with_sharding_constraint((q_a @ w["w_q_b"]).reshape(t, mla.heads, qk), heads)
        q_nope, q_rope = q[..., : mla.qk_nope_head_dim], _rotary(q[..., mla.qk_nope_head_dim :], meta.positions)
        q_latent = jnp.einsum("thd,hdc->thc", q_nope, w["w_uk"])
        kv_a = h @ w["w_kv_a"]  # the shared latent, replicated
        c_kv = _rms_norm(kv_a[:, : mla.kv_lora_rank], w["kv_a_ln"])
        k_pe = _rotary(kv_a[:, mla.kv_lora_rank :], meta.positions)
        latent, pools = attend(pools, 0, (q_latent, q_rope), c_kv, k_pe, meta, sm_scale=sm_scale, mesh=mesh)
        values = jnp.einsum("thc,hcd->thd", latent, w["w_uv"]).reshape(t, mla.heads * mla.v_head_dim)
        x = x + jax.lax.with_sharding_constraint(values @ w["w_o"], replicated)  # all-reduce 1
        return _swiglu(w, x, replicated), pools

    return mla_step


def jit_layer_step(shape: LayerShape, mesh: Mesh) -> Any:
    """:func:`layer_step` jitted with explicit in/out shardings (those of :func:`layer_inputs`)
    and the pools (argument 1) donated."""
    weights, pools, x, meta = layer_inputs(shape, mesh)

    def sharding_of(tree: Any) -> Any:
        return jax.tree.map(lambda s: s.sharding, tree)

    ins = (sharding_of(weights), sharding_of(pools), x.sharding, sharding_of(meta))
    return jax.jit(layer_step(shape, mesh), in_shardings=ins, out_shardings=(x.sharding, ins[1]), donate_argnums=1)


# --- reading the compiled program ----------------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_DTYPE_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COLLECTIVE = re.compile(
    r"=\s*(?P<result>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its opcode and the bytes of its result."""

    op: str
    nbytes: int


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of a compiled program's text (an async pair counted once, at
    its ``-start``), with the bytes of its result arrays (for ``-start``, of its first operand
    shapes: the result tuple repeats them)."""
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        arrays = [(dt, dims) for dt, dims in _ARRAY.findall(match.group("result")) if dt in _DTYPE_BYTES]
        if match.group("start"):  # (operands..., results...) of an async start: count the results
            arrays = arrays[len(arrays) // 2 :] if len(arrays) > 1 else arrays
        nbytes = sum(_DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in arrays)
        found.append(Collective(match.group("op"), nbytes))
    return found
