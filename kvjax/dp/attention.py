"""`dp_attend`: one layer's write-then-attend for every DP rank at once, each over its own pools.

Each DP rank's requests attend only over its own slice of the pools. The batch of every rank is
stacked along a leading rank axis (``stack_rank_inputs`` pads the ranks' token counts to one),
sharded over the mesh's ``"data"`` axis; query and KV heads are sharded over ``"tp"``. Inside
``jax.shard_map`` over ``("data", "tp")`` every device holds one rank's metadata and one
device's share of that rank's heads and pools, and runs kvjax's single-device ``attend`` on
them: the same kernels, on the same data, as an unsharded per-rank call on those heads.
Attention needs no collective: heads and ranks are independent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention.attend import attend
from kvjax.attention.metadata import AttentionMetadata
from kvjax.build import KV_HEAD_MESH_AXIS
from kvjax.dp.layout import DPLayout
from kvjax.dp.rank_mesh import DATA_MESH_AXIS
from kvjax.mesh_check import DCP_AXIS
from kvjax.pools.cache_pools import CachePools

__all__ = ["dp_attend", "laid_out", "stack_rank_inputs"]

# Fields of the metadata (and of its SWA part) indexed by token: padded with 0 (position 0,
# slot 0 on the trash page) when a rank has fewer tokens than the stack.
_TOKEN_FIELDS = ("positions", "out_loc")


def dp_attend(
    pools: CachePools,
    layer_id: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    meta: AttentionMetadata,
    *,
    layout: DPLayout,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[jax.Array, CachePools]:
    """Write layer ``layer_id``'s K/V of every rank's batch into that rank's pools, then attend.

    Args:
        pools: ``DPKVCache.pools`` (leading rank axis).
        layer_id: the model's global layer id.
        q: ``[dp, T, heads, head_dim]`` (rotary embedding applied).
        k: ``[dp, T, kv_heads, head_dim]``.
        v: ``[dp, T, kv_heads, v_head_dim]``.
        meta: every rank's metadata, stacked (``stack_rank_inputs``): each leaf ``[dp, ...]``.
        layout: ``DPKVCache.layout`` (the mesh and the pools' specs).
        sm_scale, soft_cap, sliding_window: as ``kvjax.attention.attend``.

    Returns:
        ``(out [dp, T, heads, head_dim], pools)``: rank ``r``'s output and pools equal those of
        ``attend`` on rank ``r``'s pools and inputs alone.

    Raises:
        ValueError: inputs without the leading rank axis, or heads that do not split over
            ``"tp"``.
        NotImplementedError: pools striped over a ``"dcp"`` axis (the DP step attends them).
    """
    if DCP_AXIS in layout.mesh.axis_names:
        raise NotImplementedError(
            "dp_attend over pools striped over decode-context-parallel ranks is not built; the DP step "
            "(kvjax.dp.step.make_dp_step) runs their DCP attention per rank"
        )
    dp, tp = layout.dp_size, layout.attn_tp_size
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != dp:
            raise ValueError(f"{name} has shape {x.shape}; expected [dp={dp}, tokens, heads, head_dim]")
        if x.shape[2] % tp:
            raise ValueError(
                f"{name}: {x.shape[2]} heads do not split over the mesh's {KV_HEAD_MESH_AXIS!r} axis of {tp} devices"
            )
    heads = P(DATA_MESH_AXIS, None, KV_HEAD_MESH_AXIS, None)
    meta_specs = jax.tree.map(lambda _: P(DATA_MESH_AXIS), meta)

    def per_device(
        pools: CachePools, q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMetadata
    ) -> tuple[jax.Array, CachePools]:
        one = jax.tree.map(lambda x: x[0], (pools, q, k, v, meta))
        out, new = attend(
            one[0],
            layer_id,
            one[1],
            one[2],
            one[3],
            one[4],
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
        )
        return out[None], jax.tree.map(lambda x: x[None], new)

    run = jax.shard_map(
        per_device,
        mesh=layout.mesh,
        in_specs=(layout.pool_specs, heads, heads, heads, meta_specs),
        out_specs=(heads, layout.pool_specs),
        check_vma=False,
    )
    q, k, v = (laid_out(x, layout, heads) for x in (q, k, v))
    meta = jax.tree.map(lambda x: laid_out(x, layout, P(DATA_MESH_AXIS)), meta)
    out, new_pools = run(pools, q, k, v, meta)
    return out, new_pools


def laid_out(x: Any, layout: DPLayout, spec: P) -> Any:
    """``x`` resharded to ``spec`` over a mesh with explicit axes (``jax.make_mesh``'s default),
    where ``shard_map`` requires its inputs' shardings to match its specs; as is over a mesh of
    automatic axes (``shard_map`` then lays it out itself)."""
    if all(t != AxisType.Explicit for t in layout.mesh.axis_types):
        return x
    return jax.reshard(x, NamedSharding(layout.mesh, spec))


def stack_rank_inputs(
    tokens: Sequence[np.ndarray], metas: Sequence[AttentionMetadata]
) -> tuple[np.ndarray, AttentionMetadata]:
    """Every rank's step inputs (``MetadataBuilder.build`` per rank, in rank order) stacked
    along a leading rank axis: ``(tokens [dp, T], metadata with leaves [dp, ...])``.

    ``T`` is the largest token count over the ranks; a rank with fewer tokens is padded with
    padding tokens (token 0 at position 0, written to slot 0 on the trash page), which its
    sequences never read. Every other field must have the same shape on every rank (the same
    ``max_seqs`` and page-table width: the ranks share one plan and one step shape).

    Raises:
        ValueError: no rank, ``tokens`` and ``metas`` of different lengths, or a non-token field
            whose shape differs between ranks.
    """
    if not metas or len(tokens) != len(metas):
        raise ValueError(f"give one token array per rank's metadata ({len(tokens)} tokens, {len(metas)} metadata)")
    width = max(int(t.shape[0]) for t in tokens)
    padded = [_pad_tokens(m, width) for m in metas]
    shapes = [jax.tree.map(np.shape, m) for m in padded]
    for r, s in enumerate(shapes[1:], start=1):
        if s != shapes[0]:
            raise ValueError(
                f"rank {r}'s metadata shapes {s} differ from rank 0's {shapes[0]}; build every rank's "
                "metadata with the same max_seqs and page table width"
            )
    stacked_tokens = np.stack([np.pad(np.asarray(t, np.int32), (0, width - t.shape[0])) for t in tokens])
    stacked: AttentionMetadata = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *padded)
    return stacked_tokens, stacked


def _pad_tokens(meta: AttentionMetadata, width: int) -> AttentionMetadata:
    def pad(x: Any) -> Any:  # numpy on the host (the field types are what a jitted step sees)
        x = np.asarray(x)
        return np.pad(x, (0, width - x.shape[0]))

    changes: dict[str, Any] = {name: pad(getattr(meta, name)) for name in _TOKEN_FIELDS}
    parts: list[Any] = list(meta.parts())  # dataclass parts (``MetadataPart``)
    parts = [
        dataclasses.replace(part, **{name: pad(getattr(part, name)) for name in getattr(part, "TOKEN_FIELDS", ())})
        for part in parts
    ]
    return dataclasses.replace(meta, **changes).with_parts(*parts)
