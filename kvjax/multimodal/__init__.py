"""Multimodal inputs on the host side: content hashes, the encoder-output cache and pad values.

* ``item_hash.hash_item``: the content hash of an item's encoder inputs (pixel values' bytes,
  dtype, shape, modality, preprocessing): the same in every process (SGLang's ``hash_feature``).
* ``embedding_cache.EmbeddingCache``: byte-bounded LRU of encoder outputs keyed by that hash
  (SGLang's ``MultiModalStaticCache``, sized by ``vlm_cache_size_mb``).
* ``pad_values``: the token id an item's placeholder positions carry in the request's key
  (SGLang's ``pad_value``), ``item.MultimodalItem`` and ``padded_prompt.pad_input_ids``, which
  writes them into a prompt, so the prefix tree, the tiers' page hashes and the KV events tell
  images apart.
* ``chunk_embeddings``: the encoder outputs one prefill chunk needs, through the cache (SGLang's
  ``_get_chunked_embedding_by_item``).

Importing this package imports neither jax nor any kvjax layer above host.
"""

from kvjax.multimodal.chunk_embeddings import ChunkEmbeddings, chunk_embeddings
from kvjax.multimodal.embedding_cache import EmbeddingCache, EmbeddingCacheStats
from kvjax.multimodal.item import MultimodalItem
from kvjax.multimodal.item_hash import hash_item
from kvjax.multimodal.pad_values import MM_PAD_SHIFT_VALUE, check_vocab_size, is_pad_value, pad_value
from kvjax.multimodal.padded_prompt import pad_input_ids, placeholder_ranges

__all__ = [
    "MM_PAD_SHIFT_VALUE",
    "ChunkEmbeddings",
    "EmbeddingCache",
    "EmbeddingCacheStats",
    "MultimodalItem",
    "check_vocab_size",
    "chunk_embeddings",
    "hash_item",
    "is_pad_value",
    "pad_input_ids",
    "pad_value",
    "placeholder_ranges",
]
