"""The layout of an MLA latent KV pool, and of the DeepSeek sparse-attention (DSA) indexer keys
that ride along with it: the one place their shapes and bytes are written (jax-free).

Latent pool, one array per layer::

    [num_pages + 1, page_size, row_padded]   row = kv_lora_rank + qk_rope_head_dim

SGLang's ``[size + page_size, 1, row]`` with the token axis split into pages and its head axis of
1 dropped: on TPU the two minor axes of an array are tiled (sublanes x 128 lanes), and a unit
head axis there would pad every token to a whole tile; with ``page_size`` as the sublane axis one
page is one dense ``[page_size, row_padded]`` tile block, which the MLA attention kernel fetches
with one DMA and multiplies as it is. Element ``[:kv_lora_rank]`` of a row is the compressed KV
(``k_nope``), ``[kv_lora_rank:row]`` the rotated ``k_rope``, the rest zero. ``row_padded`` is the
row rounded up to the platform's alignment (``kvjax.layout.alignment``: 576 -> 640 on TPU).

DSA indexer, one uint8 array per layer, SGLang's NSA page layout::

    [num_pages + 1, page_size * (index_head_dim + index_head_dim // 128 * 4)]

Within page ``p``, the first ``page_size * index_head_dim`` bytes are the fp8 (e4m3) keys of its
tokens, token by token; the next ``page_size * index_head_dim // 128 * 4`` bytes are their f32
scales (one per 128 key elements), token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvjax.layout import storage
from kvjax.layout.alignment import head_dim_alignment, round_up
from kvjax.layout.pool_plan import PoolPlan

INDEXER_SCALE_BLOCK = 128
INDEXER_SCALE_BYTES = 4


@dataclass(frozen=True)
class MLALayout:
    """Dims of one latent layer array (and of its indexer array for DSA models)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    row_padded: int
    page_size: int
    dtype: str
    storage_dtype: str
    itemsize: int
    index_head_dim: int | None = None

    @classmethod
    def for_platform(
        cls,
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        page_size: int,
        dtype: str,
        platform: str,
        index_head_dim: int | None = None,
    ) -> MLALayout:
        return cls(
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            row_padded=round_up(kv_lora_rank + qk_rope_head_dim, head_dim_alignment(platform)),
            page_size=page_size,
            dtype=dtype,
            storage_dtype=storage.storage_dtype_name(dtype, platform),
            itemsize=storage.itemsize(dtype),
            index_head_dim=index_head_dim,
        )

    def shape(self, num_pages: int) -> tuple[int, int, int]:
        """One latent layer's array for ``num_pages`` allocatable pages (the trash page added)."""
        return (num_pages + 1, self.page_size, self.row_padded)

    def indexer_shape(self, num_pages: int) -> tuple[int, int]:
        """One DSA indexer layer's uint8 array (SGLang's page layout: keys, then scales)."""
        return (num_pages + 1, self.page_size * self.indexer_bytes_per_token_per_layer)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Latent bytes of one token in one layer, padding included (indexer excluded)."""
        return self.row_padded * self.itemsize

    @property
    def indexer_bytes_per_token_per_layer(self) -> int:
        """DSA indexer bytes of one token in one layer (0 without an indexer)."""
        d = self.index_head_dim or 0
        return d + d // INDEXER_SCALE_BLOCK * INDEXER_SCALE_BYTES

    def padding(self) -> tuple[str, ...]:
        row = self.kv_lora_rank + self.qk_rope_head_dim
        if self.row_padded == row:
            return ()
        return (
            f"MLA row kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim {self.qk_rope_head_dim} = {row} "
            f"-> {self.row_padded} (TPU lane width)",
        )

    def pool_plans(
        self, *, num_pages: int, layer_ids: tuple[int, ...], built: bool, kind: str = "mla"
    ) -> tuple[PoolPlan, ...]:
        """The latent pool ``"kv"`` and, for DSA, the indexer pool ``"index_k"``."""
        pools: list[tuple[str, tuple[int, ...], str, int]] = [
            ("kv", self.shape(num_pages), self.storage_dtype, self.bytes_per_token_per_layer)
        ]
        if self.index_head_dim:
            pools.append(("index_k", self.indexer_shape(num_pages), "uint8", self.indexer_bytes_per_token_per_layer))
        return tuple(
            PoolPlan.paged(
                name,
                kind,
                shape=shape,
                dtype=dtype,
                page_size=self.page_size,
                layer_ids=layer_ids,
                bytes_per_token_per_layer=per_token,
                layout=self,
                built=built,
            )
            for name, shape, dtype, per_token in pools
        )
