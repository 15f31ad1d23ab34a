"""The layout of a paged K/V pool (full attention, and the sliding-window and host pools that
reuse it): the one place its shape, storage dtype and bytes per token are written (jax-free).

One array per layer::

    [num_pages + 1, page_size, 2 * num_kv_heads, head_dim_padded]   (storage dtype)

Page 0 is the trash page. Along the combined head axis, index ``2h`` is K of KV head ``h`` and
``2h + 1`` its V. ``head_dim_padded`` is ``max(head_dim, v_head_dim)`` rounded up to the platform's
alignment (``kvjax.layout.alignment``): tpu-inference's ragged-paged-attention layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvjax.errors import ConfigError
from kvjax.layout import storage
from kvjax.layout.alignment import head_dim_alignment, round_up
from kvjax.layout.pool_plan import PoolPlan


@dataclass(frozen=True)
class MHALayout:
    """Dims of one K/V layer array. ``num_kv_heads`` is per array (per rank when sharded)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    head_dim_padded: int
    page_size: int
    dtype: str  # logical kvjax dtype name
    storage_dtype: str
    itemsize: int

    @classmethod
    def for_platform(
        cls,
        *,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None,
        page_size: int,
        dtype: str,
        platform: str,
        head_dim_alignment_override: int | None = None,
    ) -> MHALayout:
        """The layout on ``platform`` (head dims padded to its alignment unless overridden)."""
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        align = head_dim_alignment_override or head_dim_alignment(platform)
        return cls(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            head_dim_padded=round_up(max(head_dim, v_head_dim), align),
            page_size=page_size,
            dtype=dtype,
            storage_dtype=storage.storage_dtype_name(dtype, platform),
            itemsize=storage.itemsize(dtype),
        )

    def shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """One layer's array for ``num_pages`` allocatable pages (the trash page added)."""
        return (num_pages + 1, self.page_size, 2 * self.num_kv_heads, self.head_dim_padded)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of one token's K and V in one layer, padding included."""
        return 2 * self.num_kv_heads * self.head_dim_padded * self.itemsize

    def padding(self) -> tuple[str, ...]:
        """What the layout pads, in words (empty when nothing is padded)."""
        wanted = max(self.head_dim, self.v_head_dim)
        if self.head_dim_padded == wanted and self.head_dim == self.v_head_dim:
            return ()
        if self.head_dim != self.v_head_dim and self.head_dim_padded == wanted:
            return (f"v_head_dim {self.v_head_dim} -> {wanted} (K and V share one padded head dim)",)
        dims = (
            f"head_dim {self.head_dim}"
            if self.head_dim == self.v_head_dim
            else f"head_dim {self.head_dim}/v_head_dim {self.v_head_dim}"
        )
        return (f"{dims} -> {self.head_dim_padded} (TPU lane width)",)

    def pool_plan(
        self,
        name: str,
        kind: str,
        *,
        num_pages: int,
        layer_ids: tuple[int, ...],
        memory: str = "device",
        built: bool = True,
    ) -> PoolPlan:
        """The ``PoolPlan`` of ``len(layer_ids)`` layer arrays of ``num_pages`` pages (+ trash page)."""
        return PoolPlan.paged(
            name,
            kind,
            shape=self.shape(num_pages),
            dtype=self.storage_dtype,
            page_size=self.page_size,
            layer_ids=layer_ids,
            bytes_per_token_per_layer=self.bytes_per_token_per_layer,
            layout=self,
            memory=memory,
            built=built,
        )


def kv_heads_per_rank(num_kv_heads: int, attn_tp: int) -> tuple[int, int]:
    """``(heads per rank, replicas per head)`` as SGLang splits KV heads over ``attn_tp`` ranks.

    Raises ``ConfigError`` on ``tp_size`` for a split SGLang refuses.
    """
    refusal = kv_heads_refusal(num_kv_heads, attn_tp)
    if refusal is not None:
        raise ConfigError("tp_size", attn_tp, refusal)
    if attn_tp <= num_kv_heads:
        return num_kv_heads // attn_tp, 1
    return 1, attn_tp // num_kv_heads


def kv_heads_refusal(num_kv_heads: int, attn_tp: int) -> str | None:
    """Why SGLang refuses to split ``num_kv_heads`` KV heads over ``attn_tp`` ranks, or None."""
    if attn_tp <= num_kv_heads and num_kv_heads % attn_tp:
        return f"the model's {num_kv_heads} KV heads cannot be split evenly over {attn_tp} ranks"
    if attn_tp > num_kv_heads and attn_tp % num_kv_heads:
        return (
            f"{attn_tp} ranks exceed the model's {num_kv_heads} KV heads, so each head is replicated and the TP "
            f"size must be a multiple of {num_kv_heads}"
        )
    return None
