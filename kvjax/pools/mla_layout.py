"""The layout of an MLA latent KV pool, and of the DeepSeek sparse-attention (DSA) indexer keys
that ride along with it: the one place their shapes and bytes are written (jax-free).

Latent pool, one array per layer::

    [num_pages + 1, page_size, 1, row_padded]   row = kv_lora_rank + qk_rope_head_dim

``row_padded`` is the row rounded up to the platform's alignment (``kvjax.pools.alignment``).
DSA indexer, one uint8 array per layer: ``[num_pages + 1, page_size, index_head_dim + index_head_dim
// 128 * 4]`` (fp8 keys plus one f32 scale per 128 elements), SGLang's NSA indexer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvjax.pools import storage
from kvjax.pools.alignment import head_dim_alignment, round_up
from kvjax.pools.pool_plan import PoolPlan

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

    def shape(self, num_pages: int) -> tuple[int, int, int, int]:
        return (num_pages + 1, self.page_size, 1, self.row_padded)

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
        layers = len(layer_ids)
        per_token = layers * self.bytes_per_token_per_layer
        slots = (num_pages + 1) * self.page_size
        pools = [
            PoolPlan(
                "kv",
                kind,
                self.shape(num_pages),
                self.storage_dtype,
                layers,
                slots * per_token,
                built=built,
                bytes_per_token=per_token,
                layer_ids=layer_ids,
                layout=self,
            )
        ]
        if self.index_head_dim:
            per_token = layers * self.indexer_bytes_per_token_per_layer
            pools.append(
                PoolPlan(
                    "index_k",
                    kind,
                    (num_pages + 1, self.page_size, self.indexer_bytes_per_token_per_layer),
                    "uint8",
                    layers,
                    slots * per_token,
                    built=built,
                    bytes_per_token=per_token,
                    layer_ids=layer_ids,
                    layout=self,
                )
            )
        return tuple(pools)
