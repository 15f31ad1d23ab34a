"""The DCP attention step compiled for ``v5e:2x4`` without a TPU: the query gather and the
log-sum-exp merge over the DCP ranks are the only collectives.

DCP divides the TP group: one layer's write-then-attend over a bf16 pool striped over a ``("tp",
"dcp")`` mesh of 2 x 4 chips (TP 8 with DCP 4: pages of 16 rows per chip, 16 query heads split
over all 8 chips, 2 each), jitted with the pool donated: GQA with 8 KV heads of 128 (4 per
``"tp"`` rank) through ``paged_attention`` (which hands a striped pool to ``dcp_attention``), and
DeepSeek-V3's MLA latent (512 + 64, padded to 640, replicated over ``"tp"``) through
``mla_attention`` (to ``dcp_mla_attention``). From the compiled program:

* every collective runs over the 4 chips of one ``"tp"`` rank (a ``"dcp"`` row): the all-gather
  of the query heads (8 per chip after it), the ``pmax`` of the log-sum-exp and the sum of the
  softmax weights (all-reduces of ``tokens x 8`` float32) and the reduce-scatter of the partial
  outputs, each chip keeping its own 2 heads; nothing else moves between chips (the pool is never gathered or
  resharded, each chip writes its own rows);
* the pool is updated in place: the aliased bytes cover its per-chip shard;
* each chip's partial attention is the ragged paged attention Pallas kernel (GQA) or the MLA one
  (a Mosaic custom call), with its log-sum-exp.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

TOPOLOGY = "v5e:2x4"
DCP, TP = 4, 8  # TP 8 chips, DCP 4 of them: ("tp", "dcp") = (2, 4)
KV_RANKS = TP // DCP
PAGE, PAGES, KV_HEADS, HEAD_DIM, HEADS = 16, 256, 8, 128, 16
TOKENS, SEQS, PAGES_PER_SEQ = 16, 8, 16
LATENT, ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim
LAYERS = ["mha", "mla"]


@functools.cache
def _compiled(layer: str) -> tuple[Any, str, Any]:
    """(mesh, compiled text, memory analysis) of one layer's step (``"mha"`` or ``"mla"``),
    compiled once per module run."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.attention import AttentionMetadata
    from kvjax.attention.mla_attention import mla_attention
    from kvjax.attention.paged_attention import paged_attention
    from kvjax.pools import MHAKVPool, MLAKVPool

    devices = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY).devices
    mesh = Mesh(np.array(devices).reshape(KV_RANKS, DCP), ("tp", "dcp"), axis_types=(AxisType.Auto,) * 2)

    def placed(shape: tuple[int, ...], dtype: Any, spec: P | None = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P() if spec is None else spec))

    def i32(*shape: int) -> jax.ShapeDtypeStruct:
        return placed(shape, jnp.int32)

    meta = AttentionMetadata(
        positions=i32(TOKENS),
        out_loc=i32(TOKENS),
        kv_lens=i32(SEQS),
        page_indices=i32(SEQS, PAGES_PER_SEQ),
        cu_q_lens=i32(SEQS + 1),
        num_seqs=i32(1),
        logits_indices=i32(SEQS),
    )
    shared = dict(num_pages=PAGES, page_size=PAGE * DCP, num_layers=1, dtype="bfloat16", platform="tpu")
    if layer == "mha":
        plain = jax.eval_shape(lambda: MHAKVPool.create(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, **shared))
        pool = plain.replace(
            kv=tuple(placed(a.shape, a.dtype, P(None, "dcp", "tp", None)) for a in plain.kv),
            k_scale=placed(plain.k_scale.shape, jnp.float32),
            v_scale=placed(plain.v_scale.shape, jnp.float32),
            mesh=mesh,
            kv_head_axis="tp",
            context_axis="dcp",
        )
        q = placed((TOKENS, HEADS, HEAD_DIM), jnp.bfloat16, P(None, ("tp", "dcp"), None))
        k = v = placed((TOKENS, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        step = functools.partial(paged_attention, layer_id=0)
    else:
        plain = jax.eval_shape(lambda: MLAKVPool.create(kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, **shared))
        pool = plain.replace(
            kv=tuple(placed(a.shape, a.dtype, P(None, "dcp", None)) for a in plain.kv),
            scale=placed(plain.scale.shape, jnp.float32),
            mesh=mesh,
            context_axis="dcp",
        )
        heads = P(None, ("tp", "dcp"), None)
        q = (placed((TOKENS, HEADS, LATENT), jnp.bfloat16, heads), placed((TOKENS, HEADS, ROPE), jnp.bfloat16, heads))
        k, v = placed((TOKENS, LATENT), jnp.bfloat16), placed((TOKENS, ROPE), jnp.bfloat16)

        def step(pool: Any, q: Any, k: Any, v: Any, meta: Any) -> Any:
            return mla_attention(pool, 0, q[0], q[1], k, v, meta, sm_scale=0.1)

    def run(pool: Any, q: Any, k: Any, v: Any, meta: Any) -> Any:
        return step(pool=pool, q=q, k=k, v=v, meta=meta)

    compiled = jax.jit(run, donate_argnums=0).trace(pool, q, k, v, meta).lower().compile()
    return mesh, compiled.as_text(), compiled.memory_analysis()


def _f32_elements(shapes: str) -> int:
    """Float32 elements of the shapes written in ``shapes`` (an HLO result type)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"f32\[([\d,]*)\]", shapes))


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives(text: str) -> list[tuple[str, str]]:
    """``(kind, instruction)`` of every collective of the compiled text."""
    found = []
    for line in text.splitlines():
        for kind in _COLLECTIVES:
            if re.search(rf"\b{kind}(-start)?\(", line) and " = " in line:
                found.append((kind, line.strip()))
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_the_query_gather_and_the_merge_run_over_the_dcp_ranks_and_nothing_else_moves(layer: str) -> None:
    mesh, text, _memory = _compiled(layer)
    ops = _collectives(text)
    kinds = {kind for kind, _ in ops}
    assert kinds <= {"all-gather", "all-reduce", "reduce-scatter"}, sorted(kinds)
    assert kinds == {"all-gather", "all-reduce", "reduce-scatter"}, kinds
    groups = {tuple(sorted(int(d.id) for d in mesh.devices[t, :])) for t in range(KV_RANKS)}
    for _kind, op in ops:
        found = re.search(r"replica_groups=\{(.*?)\}\}", op) or re.search(r"replica_groups=\[[^\]]*\]<=\[[^\]]*\]", op)
        assert found is not None, op
        if found.group(0).startswith("replica_groups={"):
            listed = {
                tuple(sorted(int(i) for i in g.split(","))) for g in re.findall(r"\{([\d,]+)", found.group(1) + "}")
            }
            assert listed == groups, f"a collective not over the dcp ranks: {op[:200]}"
    gathered = HEADS // KV_RANKS  # the query heads of one tp rank's KV heads
    reduced = sum(_f32_elements(op.split(" all-reduce")[0]) for kind, op in ops if kind == "all-reduce")
    # The pmax of the lse and the softmax denominators' sum (XLA keeps that small reduce-scatter
    # of [tokens, heads] as an all-reduce), each tokens x the gathered heads.
    assert reduced == 2 * TOKENS * gathered, f"{layer}: {reduced} floats all-reduced"
    width = HEAD_DIM if layer == "mha" else LATENT  # the output per head: V, or the latent
    scattered = sum(_f32_elements(op.split(" reduce-scatter")[0]) for kind, op in ops if kind == "reduce-scatter")
    assert scattered == TOKENS * (HEADS // TP) * width, f"{layer}: {scattered} floats kept after the reduce-scatter"


@pytest.mark.parametrize("layer", LAYERS)
def test_the_partial_attention_is_the_pallas_kernel(layer: str) -> None:
    """Each chip's partial attention over its stripe is the ragged paged attention kernel (MHA or
    MLA, with its log-sum-exp), not XLA's: the compiled step calls a Mosaic kernel."""
    _mesh, text, _memory = _compiled(layer)
    assert 'custom_call_target="tpu_custom_call"' in text


@pytest.mark.parametrize("layer", LAYERS)
def test_the_striped_pool_is_updated_in_place(layer: str) -> None:
    _mesh, text, memory = _compiled(layer)
    row = (2 * KV_HEADS // KV_RANKS) * HEAD_DIM if layer == "mha" else 640  # a token's bf16 elements per chip
    shard = (PAGES + 1) * PAGE * row * 2  # bf16 bytes of one chip's rows
    assert "input_output_alias" in text
    assert memory.alias_size_in_bytes >= shard, f"{memory.alias_size_in_bytes} bytes aliased, the shard is {shard}"
