"""Multimodal inputs on the host side: content hashes and the encoder-output cache.

* ``item_hash.hash_item``: the content hash of an item's encoder inputs (pixel values' bytes,
  dtype, shape, modality, preprocessing): the same in every process (SGLang's ``hash_feature``).
* ``embedding_cache.EmbeddingCache``: byte-bounded LRU of encoder outputs keyed by that hash
  (SGLang's ``MultiModalStaticCache``, sized by ``vlm_cache_size_mb``).

Importing this package imports neither jax nor any kvjax layer above host.
"""

from kvjax.multimodal.embedding_cache import EmbeddingCache, EmbeddingCacheStats
from kvjax.multimodal.item_hash import hash_item

__all__ = ["EmbeddingCache", "EmbeddingCacheStats", "hash_item"]
