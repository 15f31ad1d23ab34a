"""The DCP attention step compiled for ``v5e:2x4`` without a TPU: the log-sum-exp merge is the only
collective.

One layer's write-then-attend over a bf16 pool striped over a ``("dcp", "tp")`` mesh of 4 x 2
chips (8 KV heads of 128, 16 query heads, pages of 16 rows per chip), jitted with the pool
donated, through ``paged_attention`` (which hands a striped pool to ``dcp_attention``). From the
compiled program:

* the merge over ``"dcp"`` is two all-reduces (the ``pmax`` of the log-sum-exp, and one of the
  partial outputs and weights, which XLA combines), each over the 4 chips of one ``"tp"`` rank,
  of ``tokens x heads per chip x (head_dim + 2)`` float32 in all; nothing else moves between
  chips (the pool is never gathered or resharded, each chip writes its own rows);
* the pool is updated in place: the aliased bytes cover its per-chip shard.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

TOPOLOGY = "v5e:2x4"
DCP, TP = 4, 2
PAGE, PAGES, KV_HEADS, HEAD_DIM, HEADS = 16, 256, 8, 128, 16
TOKENS, SEQS, PAGES_PER_SEQ = 16, 8, 16


@functools.cache
def _compiled() -> tuple[Any, str, Any]:
    """(mesh, compiled text, memory analysis) of the step, compiled once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.attention import AttentionMetadata
    from kvjax.attention.paged_attention import paged_attention
    from kvjax.pools import MHAKVPool

    devices = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY).devices
    mesh = Mesh(np.array(devices).reshape(DCP, TP), ("dcp", "tp"), axis_types=(AxisType.Auto,) * 2)

    def placed(shape: tuple[int, ...], dtype: Any, spec: P | None = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P() if spec is None else spec))

    plain = jax.eval_shape(
        lambda: MHAKVPool.create(
            num_pages=PAGES,
            page_size=PAGE * DCP,
            num_layers=1,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            dtype="bfloat16",
            platform="tpu",
        )
    )
    pool = plain.replace(
        kv=tuple(placed(a.shape, a.dtype, P(None, "dcp", "tp", None)) for a in plain.kv),
        k_scale=placed(plain.k_scale.shape, jnp.float32),
        v_scale=placed(plain.v_scale.shape, jnp.float32),
        mesh=mesh,
        kv_head_axis="tp",
        context_axis="dcp",
    )

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

    def step(pool: Any, q: Any, k: Any, v: Any, meta: Any) -> Any:
        return paged_attention(pool, 0, q, k, v, meta)

    q = placed((TOKENS, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = placed((TOKENS, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    compiled = jax.jit(step, donate_argnums=0).trace(pool, q, kv, kv, meta).lower().compile()
    return mesh, compiled.as_text(), compiled.memory_analysis()


def _f32_elements(shapes: str) -> int:
    """Float32 elements of the shapes written in ``shapes`` (an HLO result type)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"f32\[([\d,]*)\]", shapes))


def test_the_merge_is_two_all_reduces_over_the_dcp_ranks_and_nothing_else_moves() -> None:
    mesh, text, _memory = _compiled()
    ops = [line.strip() for line in text.splitlines() if re.search(r"\ball-reduce(-start)?\(", line) and " = " in line]
    assert len(ops) == 2, "\n".join(ops)
    groups = {tuple(sorted(int(d.id) for d in mesh.devices[:, t])) for t in range(TP)}
    for op in ops:
        found = re.search(r"replica_groups=\{(.*?)\}\}", op)
        assert found is not None, op
        listed = {tuple(sorted(int(i) for i in g.split(","))) for g in re.findall(r"\{([\d,]+)", found.group(1) + "}")}
        assert listed == groups, f"an all-reduce not over the dcp ranks: {op[:200]}"
    payload = sum(_f32_elements(op.split(" all-reduce")[0]) for op in ops)
    heads = HEADS // TP
    assert payload == TOKENS * heads * (HEAD_DIM + 2), f"{payload} floats reduced"
    for other in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert not re.search(rf"\b{other}(-start)?\(", text), f"the step has a {other}"


def test_the_striped_pool_is_updated_in_place() -> None:
    _mesh, text, memory = _compiled()
    shard = (PAGES + 1) * PAGE * (2 * KV_HEADS // TP) * HEAD_DIM * 2  # bf16 bytes of one chip's rows
    assert "input_output_alias" in text
    assert memory.alias_size_in_bytes >= shard, f"{memory.alias_size_in_bytes} bytes aliased, the shard is {shard}"
