"""`kvjax.attention`: the model-side API. A model's layers read and write kvjax's pools through it.

* ``AttentionMetadata`` (with the kind parts ``SWAMetadata``, ``StateMetadata``): where a ragged
  batch's tokens live, as typed fields; a pytree, passed into the jitted step.
* ``MetadataBuilder`` / ``build_attention_metadata`` / ``PageTables``: the metadata of a batch
  from the request table, the allocator's slots and the tree's prefix lengths, on the host.
* ``attend(pools, layer_id, q, k, v, meta)``: one layer's write-then-attend, the pool and kernel
  picked from the layer's kind (full, sliding-window, MLA); ``recurrent_step`` for recurrent layers.
* Every function takes an optional ``mesh`` (or reads the pool's): the Pallas kernels then run
  per device under ``jax.shard_map``.
"""

from kvjax.attention.attend import attend, attend_mla, pool_layers
from kvjax.attention.hybrid_swa_attention import hybrid_swa_attention
from kvjax.attention.metadata import (
    AttentionMetadata,
    KindMetadata,
    MetadataPart,
    StateMetadata,
    SWAMetadata,
    trace_metadata,
)
from kvjax.attention.metadata_builder import (
    MIN_TOKEN_BUCKET,
    MetadataBuilder,
    build_attention_metadata,
    swa_metadata,
    token_bucket,
)
from kvjax.attention.mla_attention import mla_attention
from kvjax.attention.page_table import PageTables, SlotTranslation
from kvjax.attention.paged_attention import paged_attention
from kvjax.attention.recurrent_step import StateUpdate, recurrent_step

__all__ = [
    "MIN_TOKEN_BUCKET",
    "AttentionMetadata",
    "KindMetadata",
    "MetadataBuilder",
    "MetadataPart",
    "PageTables",
    "SWAMetadata",
    "SlotTranslation",
    "StateMetadata",
    "StateUpdate",
    "attend",
    "attend_mla",
    "build_attention_metadata",
    "hybrid_swa_attention",
    "mla_attention",
    "paged_attention",
    "pool_layers",
    "recurrent_step",
    "swa_metadata",
    "token_bucket",
    "trace_metadata",
]
